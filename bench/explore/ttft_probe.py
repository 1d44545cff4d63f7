"""Every `generate` call of bench/model_e2e.py printed with its time: which calls of a run make its medians. The
models are named in the order of their first call, which is model_e2e's warm-up order: model0 is bf16, model1 mxgemm.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model_e2e

_generate = model_e2e.Timer.generate
_names: dict[int, str] = {}


def generate(self, model, ids, new, **kwargs):
    seconds, above, stays = _generate(self, model, ids, new, **kwargs)
    who = _names.setdefault(id(model), f"model{len(_names)}")
    mode = "graphs" if "compile_config" in kwargs else "eager"
    print(f"{who} {mode} ids={tuple(ids.shape)} new={new} {seconds * 1e3:.1f} ms", flush=True)
    return seconds, above, stays


model_e2e.Timer.generate = generate
model_e2e.main(sys.argv[1:])
