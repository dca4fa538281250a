"""Qwen3 (`model.arch=qwen3`): the Llama-style decoder with an RMSNorm of each query and key head before the rotation.
Its card (keys.py, torch-free), the model and its family (model.py: the Llama's, its option fixed), and Hugging
Face's Qwen3ForCausalLM in and out (hf.py)."""
