"""A process keeps the tokenizers of its most recent model folders, not one per checkpoint."""

import shutil

from ppoflow.tasks.models.tokenizer_cache import RecentTokenizers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _checkpoints(tiny_model_dir, tmp_path, n: int) -> list[str]:
    folders = []
    for step in range(n):
        folder = tmp_path / f"iter={step:06d}" / "actor"
        folder.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tiny_model_dir / name, folder / name)
        folders.append(str(folder))
    return folders


def test_the_most_recent_folders_tokenizers_are_kept_and_no_more(tiny_model_dir, tmp_path):
    folders = _checkpoints(tiny_model_dir, tmp_path, 12)
    tokenizers = RecentTokenizers(kept=3)
    first = tokenizers.get(folders[0])
    assert tokenizers.get(folders[0]) is first  # loaded once
    for folder in folders[1:]:
        tokenizers.get(folder)
        tokenizers.get(folders[0])  # asked for at every step: stays among the most recent
        assert len(tokenizers) <= 3
    assert tokenizers.get(folders[0]) is first
    evicted = tokenizers.get(folders[1])  # loaded again
    assert evicted.encode("12+3=") == first.encode("12+3=")
    assert len(tokenizers) == 3
