"""ppoflow: RL for language models (PPO with critic and GAE, GRPO and relatives) as a Prefect
workflow of cached stages whose every output is parquet you can query with DuckDB."""

__version__ = "0.1.0"
