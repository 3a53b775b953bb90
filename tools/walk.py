#!/usr/bin/env python3
"""Count, during one cold-hit fetch and one insert that splits a node, the calls that
cross from one promptstore module into another (a 'stay' in the callee), by pair.

    python tools/walk.py CHECKOUT    (a checkout of the repository: its promptstore/ is traced)

Written for the architecture step's figures (a restore's and an insert's walk
through tiers.py before and after); kept in git history, not in the tree."""

import collections
import os
import sys
import tempfile

root = sys.argv[1]
sys.path.insert(0, root)
os.environ["PROMPTSTORE_COLD_PLAN"] = "load"
import mlx.core as mx

from promptstore import PromptStore
from promptstore.testing.models import tiny_model

model = tiny_model("llama")
toks = mx.random.randint(0, 256, (300,), key=mx.random.key(1))
other = mx.concatenate([toks[:150], mx.random.randint(0, 256, (150,), key=mx.random.key(2))])


def fill(space, t):
    hit = space.fetch(t)
    model(t[hit.length :][None], cache=hit.cache)
    mx.eval([c.state for c in hit.cache])
    return hit


tmp = tempfile.mkdtemp()
with PromptStore.open(tmp, durability="sync") as s:
    sp = s.bind(model, model_id="m")
    h = fill(sp, toks)
    sp.insert(toks, h.cache)


def trace(fn):
    pairs = collections.Counter()
    depth = [0]

    def mod(frame):
        f = frame.f_code.co_filename
        return os.path.relpath(f, root) if f.startswith(os.path.join(root, "promptstore")) else None

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = mod(frame)
        caller = mod(frame.f_back) if frame.f_back else None
        if callee and caller and callee != caller:
            pairs[(caller, callee)] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return pairs


with PromptStore.open(tmp, durability="sync", hot_bytes=0, warm_start=False) as s:
    sp = s.bind(model, model_id="m")
    restore = trace(lambda: sp.fetch(mx.concatenate([toks, toks[:1]])))
    h = sp.fetch(other)
    model(other[h.length :][None], cache=h.cache)
    mx.eval([c.state for c in h.cache])
    insert = trace(lambda: sp.insert(other, h.cache))
for name, pairs in (("restore", restore), ("insert", insert)):
    r2t = sum(
        v
        for (a, b), v in pairs.items()
        if a in ("promptstore/store/restore.py", "promptstore/store/insert.py")
        and b.startswith("promptstore/store/tiers")
    )
    into_tiers = sum(v for (a, b), v in pairs.items() if b == "promptstore/store/tiers.py")
    print(
        f"{name}: module crossings {sum(pairs.values())}; calls into tiers.py {into_tiers} (from restore.py/insert.py: {r2t})"
    )
    for (a, b), v in sorted(pairs.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {v:4d}  {a} -> {b}")
