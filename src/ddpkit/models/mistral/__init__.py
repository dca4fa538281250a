"""Mistral (`model.arch=mistral`): the Llama-style decoder with sliding-window attention (model.sliding_window). Its
card and its own key (keys.py, torch-free), the model and its family (model.py: the Llama's, its window from the
config), and Hugging Face's MistralForCausalLM in and out (hf.py)."""
