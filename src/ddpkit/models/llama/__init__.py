"""The built-in Llama-style decoder (`model.arch=llama`): its card and config keys (keys.py, torch-free), the model
and its family (model.py), and Hugging Face's Llama in and out (hf.py)."""
