"""Qwen2 (`model.arch=qwen2`): the Llama-style decoder with biases on its query, key and value projections. Its card
(keys.py, torch-free), the model and its family (model.py: the Llama's, its option fixed), and Hugging Face's
Qwen2ForCausalLM in and out (hf.py)."""
