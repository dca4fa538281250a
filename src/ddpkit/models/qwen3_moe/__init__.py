"""Qwen3-MoE's shape (`model.arch=qwen3_moe`): the Mixtral-shaped decoder (models/mixtral/) with an RMSNorm of each
query and key head (Qwen3's), routed experts every model.moe_every-th block (Qwen-MoE's decoder_sparse_step). Its
card (keys.py, torch-free), the model and its family (model.py), Hugging Face's Qwen3-MoE in and out (hf.py)."""
