"""The language model's commands after training: `ddpkit generate` (generate.py, text from a run) and `ddpkit
export` (export.py, a run as a Hugging Face folder); they stand on models/loading.py."""
