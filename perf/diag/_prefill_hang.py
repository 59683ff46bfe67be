import sys, torch
sys.path.insert(0, 'tests')
from graph_replay import build
from kernelmux.backends.cuda import attention, prefill
from kernelmux.engine import probes
from kernelmux.ops.specs import paged_attention as pa
prefill._DEFINES = ("KERNELMUX_WATCHDOG",)
config = sys.argv[1]
q, kv, heads, kvh, ctas, fields = {
    "one_tile": ((128,), (128,), 1, 1, None, {}),
    "one_tile_serial": ((128,), (128,), 1, 1, None, {"overlap": False, "pingpong": False}),
    "one_tile_cta_per_tile": ((128,), (128,), 1, 1, None, {"persistent": False}),
    "two_tiles_one_cta": ((128,), (128,), 2, 2, 1, {}),
    "two_tiles_one_cta_serial": ((128,), (128,), 2, 2, 1, {"overlap": False, "pingpong": False}),
    "three_tiles_one_cta": ((128,), (128,), 3, 3, 1, {}),
    "smoke": ((300, 77, 1, 0, 900), (1029, 333, 5, 7, 900), 8, 2, None, {}),
    "smoke_cta_per_tile": ((300, 77, 1, 0, 900), (1029, 333, 5, 7, 900), 8, 2, None, {"persistent": False}),
}[config]
if ctas is not None:
    probes.compute_units = lambda device: ctas
kw = build(pa._maker(q, kv, heads, kvh, 128), 0, 'cuda')
exp = pa.SPEC.reference(**kw)
with prefill.override_plan(**fields):
    out = attention.paged_attention(**kw)
    torch.cuda.synchronize()
print(config, 'ok', (out.float() - exp.float()).abs().max().item(), flush=True)
