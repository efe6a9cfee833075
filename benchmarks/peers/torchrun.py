"""torchrun, usable on Debian 12: `python3 benchmarks/peers/torchrun.py ARGS` == `torchrun ARGS`.

Debian 12's python3-torch 1.13.1 runs on Python 3.11, where iterating an IntFlag skips its zero
member, so torch's Std.from_str("0") (the default of --redirects and --tee) returns None and
torchrun dies before starting a rank ("'NoneType' object has no attribute 'get'"). This runs
torch.distributed.run's own main with that parser fixed, and only when it is broken; launching,
rendezvous and the environment every rank sees are torchrun's.
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.run import main

if Std.from_str("0") is None:
    def from_str(text):
        if re.fullmatch(r"[0123]", text):
            return Std(int(text))
        if re.fullmatch(r"(\d:[0123],)*(\d:[0123])", text):
            return {int(i): Std(int(v)) for i, v in (m.split(":") for m in text.split(","))}
        raise ValueError(f"{text} does not match: <[0123]> or <(\\d:[0123],)*(\\d:[0123])>")

    Std.from_str = staticmethod(from_str)

if __name__ == "__main__":
    sys.exit(main())
