"""Step 8: a rendezvous through a shared file in place of an address; every rank is still given by hand.

    python examples/08_shared_file.py --init-method file:///tmp/ddpkit_sharedfile --rank 0 --world-size 2
    python examples/08_shared_file.py --init-method file:///tmp/ddpkit_sharedfile --rank 1 --world-size 2

On one machine any folder will do; across machines the file must be on a file system every node sees (e.g.
file:///mnt/nfs/sharedfile). It must not exist beforehand: a file left over from an earlier job can hang or
confuse the rendezvous, and torch removes it only once every process's store object is destroyed, which an
exit does not guarantee, so delete it between jobs. Everything else is step 7.
"""

from __future__ import annotations

import importlib

tcp_three_terminals = importlib.import_module("07_tcp_three_terminals")

if __name__ == "__main__":
    tcp_three_terminals.main(default_init_method="file:///tmp/ddpkit_sharedfile", doc=__doc__)
