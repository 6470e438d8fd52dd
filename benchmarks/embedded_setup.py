"""What the benchmarks that run the embedded default through `ppoflow train`'s flow do first: quiet
logs, no analytics, and the tiny base model built once per machine, outside the timing. Imported by
the scripts in this folder."""

from __future__ import annotations

import os
import subprocess
import sys

QUIET = {
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "TRANSFORMERS_VERBOSITY": "error",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def prepare(**environment: str) -> None:
    """Set QUIET and `environment` where the caller's environment does not, import torch and
    transformers (before any clock starts), and build the embedded default's base model in a process
    of its own: this one must not import prefect before `prefect_api()` has set PREFECT_API_URL."""
    for key, value in (QUIET | environment).items():
        os.environ.setdefault(key, value)
    import ppoflow.engine.models  # noqa: F401

    build = "from ppoflow.tasks.stages.prepare_model import build_tiny_base; build_tiny_base(seed=1)"
    subprocess.run([sys.executable, "-c", build], check=True)
