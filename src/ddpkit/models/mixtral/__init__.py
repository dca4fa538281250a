"""The Mixtral-shaped decoder (`model.arch=mixtral`, or `model.arch=llama` with `model.n_experts`): the Llama with
routed experts (models/experts.py) as the MLP of every model.moe_every-th block. Its card (keys.py, torch-free), the
model and its family (model.py), and Hugging Face's Mixtral in and out (hf.py)."""
