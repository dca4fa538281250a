"""The built-in GPT-2-style decoder (`model.arch=gpt`): its card and config keys (keys.py, torch-free), the model
and its family (model.py: the parallel facts, FLOPs per token, size estimate), and Hugging Face's GPT-2 in and out
(hf.py)."""
