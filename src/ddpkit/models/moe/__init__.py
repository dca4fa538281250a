"""Routed experts (a mixture of experts), the part the mixture-of-experts families share: their config keys and
checks (keys.py, torch-free), the router, the experts and the block's MLP that routes each token to its
experts (layer.py), the experts' matmuls (matmul.py). A family of such blocks (models/mixtral/,
models/qwen3_moe/) builds its blocks with `MoE` as their MLP; expert parallelism (parallel/experts/) splits the
experts over dist.ep ranks and sends each token to its experts' rank."""
