"""Exploration (GPU host): kernel variants of the blockwise FP8 quantizer on the Qwen3-8B shape."""
import json, os, statistics, sys, time, traceback
from pathlib import Path
import torch, triton, triton.language as tl
sys.path.insert(0, str(Path(__file__).parent)); sys.path.insert(0, str(Path(__file__).parents[2])); sys.path.insert(0, str(Path(__file__).parents[1]))
import variants as V
from mbridge_refit import fp8, fp8_kernels
from bench_fp8_kernels import layer_weights, run_jobs

OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "explore.jsonl", "a")
def emit(**kw):
    print(json.dumps(kw), flush=True); LOG.write(json.dumps(kw) + "\n"); LOG.flush()

def device_ms(fn, repeats=9):
    times = []
    for _ in range(repeats + 1):
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); b.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(b.elapsed_time(e))
    return statistics.median(times[1:]), min(times[1:])

from types import SimpleNamespace
config = SimpleNamespace(**json.loads((Path(__file__).parents[2] / "recipes/shapes/qwen3-8b.json").read_text())["hf_config"])
gen = torch.Generator(device="cuda").manual_seed(0)
def weight(shape):
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)
def outputs(shape):
    return (torch.empty(shape, dtype=fp8.FP8_DTYPE, device="cuda"), torch.empty(fp8.scale_shape(tuple(shape)), dtype=torch.float32, device="cuda"))
layers = []
for _ in range(config.num_hidden_layers):
    tensors, runs = layer_weights(config, weight)
    qkv = tensors[0][1]; layer = []
    for name, sel in runs.items():
        rows = sel[-1][0] + sel[-1][2]
        layer += run_jobs(qkv, sel, *outputs((rows, qkv.shape[1])))
    layer += [(x, *outputs(x.shape)) for _, x in tensors[1:]]
    layers.append(layer)
jobs = [j for l in layers for j in l]
nbytes = sum(x.numel() * 3 for x, _, _ in jobs)
sms = torch.cuda.get_device_properties(0).multi_processor_count
emit(what="setup", device=torch.cuda.get_device_name(), sms=sms, jobs=len(jobs), gbytes=nbytes / 1e9, triton=triton.__version__)

flat = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
emit(what="clone_floor", ms=device_ms(lambda: flat.clone()))
del flat
# reference bits: the production kernel (checked against the torch path on layer 0)
base = [fp8_kernels.grouped_launch(l) for l in layers]
for b in base: fp8_kernels.launch_grouped(b)
for x, q, s in layers[0]:
    rq, rs = torch.empty_like(q), torch.empty_like(s)
    fp8._quantize_torch(x, rq, rs, torch.empty(fp8.padded_shape(tuple(x.shape)), device="cuda"))
    assert torch.equal(rq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs, s)
ref = [(q.view(torch.uint8).clone(), s.clone()) for _, q, s in jobs]
def exact():
    return all(torch.equal(q.view(torch.uint8), rq) and torch.equal(s, rs) for (_, q, s), (rq, rs) in zip(jobs, ref))
def scramble():
    for _, q, s in jobs: q.view(torch.uint8).fill_(0xFF); s.fill_(-1)
emit(what="production", per_layer=device_ms(lambda: [fp8_kernels.launch_grouped(b) for b in base]),
     one_launch=device_ms(lambda: fp8_kernels.launch_grouped(one)) if (one := fp8_kernels.grouped_launch(jobs)) else None)

probes = fp8_kernels._probe_tensors()
probe_jobs = [(x, *outputs(x.shape)) for x in probes if fp8_kernels.grouped_takes(x)]
def probe_exact(launch_fn):
    for _, q, s in probe_jobs: q.view(torch.uint8).fill_(0xFF); s.fill_(-1)
    launch_fn(probe_jobs); torch.cuda.synchronize()
    return all(fp8_kernels._same_bits(q, s, x) for x, q, s in probe_jobs)

def grouped_table(js, chunk_blocks=128):
    pieces = [p for j in js for p in fp8_kernels._chunks(*j, chunk_blocks)]
    rows = [(x.data_ptr(), q.data_ptr(), s.data_ptr(), x.shape[0], x.shape[1], x.stride(0), q.stride(0), s.shape[1]) for x, q, s in pieces]
    return torch.tensor(rows, dtype=torch.int64, device="cuda"), len(rows), max(s.numel() for _, _, s in pieces)

def persistent_table(js, n_programs):
    """Descriptor rows (field 7: block columns | first tile << 32) and the piece of every tile,
    padded to whole rounds of n_programs with an empty piece (rows 0: every access masked)."""
    rows, tile_piece, first = [], [], 0
    for i, (x, q, s) in enumerate(js):
        n = s.numel()
        rows.append((x.data_ptr(), q.data_ptr(), s.data_ptr(), x.shape[0], x.shape[1], x.stride(0), q.stride(0), s.shape[1] | (first << 32)))
        tile_piece += [i] * n; first += n
    rounds = -(-first // n_programs)
    rows.append((js[0][0].data_ptr(), js[0][1].data_ptr(), js[0][2].data_ptr(), 0, 16, 16, 16, 1 | (first << 32)))
    tile_piece += [len(js)] * (rounds * n_programs - first)
    return torch.tensor(rows, dtype=torch.int64, device=js[0][0].device), torch.tensor(tile_piece, dtype=torch.int32, device=js[0][0].device), rounds

def run_variant(name, make_launch, groups):
    """make_launch(jobs) -> callable launching them; groups: list of job lists (per layer, or one)."""
    try:
        t0 = time.time()
        launches = [make_launch(g) for g in groups]
        for l in launches: l()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        scramble()
        for l in launches: l()
        torch.cuda.synchronize()
        ok = exact()
        pok = probe_exact(lambda pj: make_launch(pj)())
        ms = device_ms(lambda: [l() for l in launches])
        emit(what="variant", name=name, launches=len(launches), ms=ms, gb_s=nbytes / ms[0] / 1e6, exact=ok, probes_exact=pok, compile_s=compile_s)
    except Exception as err:
        emit(what="variant", name=name, error="".join(traceback.format_exception_only(err))[-800:])

def grouped_maker(kernel, warps, maxnreg=None):
    def make(js):
        table, count, maxb = grouped_table(js)
        opts = dict(num_warps=warps) | ({"maxnreg": maxnreg} if maxnreg else {})
        return lambda: kernel[(maxb, count)](table, X_DTYPE=tl.bfloat16, BLOCK_SIZE=128, **opts)
    return make

def persistent_maker(kernel, warps, stages, per_sm):
    def make(js):
        n_programs = min(sum(s.numel() for _, _, s in js), per_sm * sms)
        table, tile_piece, rounds = persistent_table(js, n_programs)
        return lambda: kernel[(n_programs,)](table, tile_piece, rounds, n_programs, X_DTYPE=tl.bfloat16, BLOCK_SIZE=128, NUM_STAGES=stages, num_warps=warps)
    return make

per_layer, whole = layers, [jobs]
S = V._q_scaled
cg = V.derive(V._make32_SRC, **{"x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)": "x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0, cache_modifier='.cg')"})
ef = V.derive(V._make32_SRC, **{"x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)": "x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0, eviction_policy='evict_first')",
                                 "tl.store(q_ptr + r * stride_q + c, q, mask=mask)": "tl.store(q_ptr + r * stride_q + c, q, mask=mask, cache_modifier='.cs')"})
cs = V.derive(V._make32_SRC, **{"tl.store(q_ptr + r * stride_q + c, q, mask=mask)": "tl.store(q_ptr + r * stride_q + c, q, mask=mask, cache_modifier='.cs')"})
def grouped_chunks(kernel, warps, chunk, maxnreg=None):
    def make(js):
        table, count, maxb = grouped_table(js, chunk)
        opts = dict(num_warps=warps) | ({"maxnreg": maxnreg} if maxnreg else {})
        return lambda: kernel[(maxb, count)](table, X_DTYPE=tl.bfloat16, BLOCK_SIZE=128, **opts)
    return make
k64, k32 = V.make(S), V.make32(S)
plan = [
    ("scaled 4w", grouped_maker(k64, 4), per_layer),
    ("scaled i32 4w", grouped_maker(k32, 4), per_layer),
    ("scaled i32 4w chunk64", grouped_chunks(k32, 4, 64), per_layer),
    ("scaled i32 4w chunk256", grouped_chunks(k32, 4, 256), per_layer),
    ("scaled i32 4w chunk512", grouped_chunks(k32, 4, 512), per_layer),
    ("scaled i32 4w whole tensors", grouped_chunks(k32, 4, None), per_layer),
    ("scaled i32 4w load .cg", grouped_maker(V.make_from(cg, S), 4), per_layer),
    ("scaled i32 4w load evict_first, store .cs", grouped_maker(V.make_from(ef, S), 4), per_layer),
    ("scaled i32 4w store .cs", grouped_maker(V.make_from(cs, S), 4), per_layer),
    ("scaled i32 8w maxnreg80", grouped_maker(k32, 8, 80), per_layer),
    ("scaled i32 8w maxnreg72", grouped_maker(k32, 8, 72), per_layer),
    ("scaled i32 8w maxnreg64", grouped_maker(k32, 8, 64), per_layer),
    ("scaled i32 4w maxnreg160", grouped_maker(k32, 4, 160), per_layer),
    ("floor: amaxonly i32 4w", grouped_maker(V.make32(V._q_amaxonly), 4), per_layer),
    ("scaled 4w [one launch]", grouped_maker(k64, 4), whole),
    ("scaled i32 4w [one launch]", grouped_maker(k32, 4), whole),
    ("scaled 4w [two layers per launch]", grouped_maker(k64, 4), [layers[i] + layers[i + 1] for i in range(0, len(layers), 2)]),
    ("scaled 4w (repeat)", grouped_maker(k64, 4), per_layer),
    ("proto current 4w (repeat)", grouped_maker(V.make(V._q_current), 4), per_layer),
]
for name, maker, groups in plan:
    run_variant(name, maker, groups)
emit(what="done")
