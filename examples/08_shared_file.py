"""SCENARIOS B.8: a rendezvous through a shared file: every rank is given explicitly.

    python examples/08_shared_file.py --init-method file:///mnt/nfs/sharedfile --rank 0 --world-size 2
    python examples/08_shared_file.py --init-method file:///mnt/nfs/sharedfile --rank 1 --world-size 2

The file must be on a file system every node sees, and must not exist beforehand: a file left over from an
earlier job can hang or confuse the rendezvous. torch removes it only once every process's store object is
destroyed, which an exit does not guarantee, so delete it between jobs. Everything else is B.7.
"""

from __future__ import annotations

import importlib

main = importlib.import_module("07_tcp_three_terminals").main  # a digit-leading name: no import statement


if __name__ == "__main__":
    main(default_init_method="file:///tmp/ddpkit_sharedfile", doc=__doc__)
