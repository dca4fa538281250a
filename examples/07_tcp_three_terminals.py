"""Step 7: three terminals and a tcp:// rendezvous: every process is started by hand with its rank.

    python examples/07_tcp_three_terminals.py --init-method tcp://127.0.0.1:22225 --rank 0 --world-size 3
    python examples/07_tcp_three_terminals.py --init-method tcp://127.0.0.1:22225 --rank 1 --world-size 3
    python examples/07_tcp_three_terminals.py --init-method tcp://127.0.0.1:22225 --rank 2 --world-size 3

Rank 0 listens on the address (on several machines: rank 0's address, reachable from the others); the
job starts only when all --world-size processes have joined. --backend chooses among gloo, nccl and mpi
(auto: nccl on GPUs, gloo on CPU). A small MNIST-style CNN trains on this rank's share of scikit-learn's
digits and rank 0 prints the mean loss and the accuracy on the whole validation set.
"""

from __future__ import annotations

import _common as common

import ddpkit


def main(default_init_method: str = "tcp://127.0.0.1:22225", doc: str = __doc__) -> None:
    parser = common.parser(doc, batch_size=32, epochs=2, lr=0.4)
    parser.add_argument("--init-method", default=default_init_method, help="tcp://HOST:PORT or file:///PATH")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl", "mpi"), default="auto")
    args = parser.parse_args()
    ctx = ddpkit.init_distributed(  # checks the URL and the ranks, then blocks until all have joined
        args.backend, init_method=args.init_method, rank=args.rank, world_size=args.world_size
    )
    if ctx.is_main:
        print(f"{ctx.world_size} processes joined at {args.init_method}, backend {ctx.backend}", flush=True)
    common.train_and_evaluate(ctx, args)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
