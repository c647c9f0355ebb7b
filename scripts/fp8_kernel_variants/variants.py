import triton, triton.language as tl
MIN_FAST_SCALE = tl.constexpr(2.0**-90)

@triton.jit
def _q_current(x):
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    y = x.to(tl.float32)
    if scale >= MIN_FAST_SCALE:
        zeros = tl.zeros_like(y)
        recip = zeros + tl.math.div_rn(1.0, scale)
        q0 = y * recip
        y = tl.fma(tl.fma(-q0, zeros + scale, y), recip, q0)
    else:
        y = tl.math.div_rn(y, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale

@triton.jit
def _q_noclamp(x):
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    y = x.to(tl.float32)
    if scale >= MIN_FAST_SCALE:
        recip = tl.full(y.shape, tl.math.div_rn(1.0, scale), tl.float32)
        q0 = y * recip
        y = tl.fma(tl.fma(-q0, tl.full(y.shape, scale, tl.float32), y), recip, q0)
    else:
        y = tl.math.div_rn(y, scale)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale

@triton.jit
def _q_scaled(x):
    # tiny scales: numerator and denominator scaled by 2^100 (exact), so one code path
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    tiny = scale < MIN_FAST_SCALE
    f = tl.where(tiny, 2.0**100, 1.0)
    s = scale * f
    y = x.to(tl.float32) * f
    recip = tl.full(y.shape, tl.math.div_rn(1.0, s), tl.float32)
    q0 = y * recip
    y = tl.fma(tl.fma(-q0, tl.full(y.shape, s, tl.float32), y), recip, q0)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale

@triton.jit
def _q_copyonly(x):
    # access-pattern floor: no amax, no quotient (not the format)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne"), 1.0

@triton.jit
def _q_amaxonly(x):
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), 448.0)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale


import sys as _sys, types as _types, tempfile as _tempfile, importlib.util as _ilu, itertools as _it
_count = _it.count()

def _instantiate(src, qfn):
    n = next(_count)
    code = f"import triton, triton.language as tl\nfrom variants import MIN_FAST_SCALE, {qfn.__name__}\n" + src.replace("qfn(", qfn.__name__ + "(")
    path = _tempfile.mktemp(suffix=f"_v{n}.py")
    open(path, "w").write(code)
    spec = _ilu.spec_from_file_location(f"_variant_{n}", path)
    mod = _ilu.module_from_spec(spec); spec.loader.exec_module(mod)
    return [v for k, v in vars(mod).items() if hasattr(v, "run") and k not in vars(_sys.modules["variants"])][0]

_make_SRC = '@triton.jit\ndef grouped(desc_ptr, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr):\n    block = tl.program_id(0)\n    d = desc_ptr + tl.program_id(1) * 8\n    rows = tl.load(d + 3)\n    n_block_cols = tl.load(d + 7)\n    if block < tl.cdiv(rows, BLOCK_SIZE) * n_block_cols:\n        x_ptr = tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16)\n        q_ptr = tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16)\n        s_ptr = tl.load(d + 2).to(tl.pointer_type(tl.float32))\n        cols = tl.multiple_of(tl.load(d + 4), 16)\n        stride_x = tl.multiple_of(tl.load(d + 5), 16)\n        stride_q = tl.multiple_of(tl.load(d + 6), 16)\n        block_row = block // n_block_cols\n        block_col = block % n_block_cols\n        r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]\n        c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]\n        mask = (r < rows) & (c < cols)\n        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)\n        q, scale = qfn(x)\n        tl.store(q_ptr + r * stride_q + c, q, mask=mask)\n        tl.store(s_ptr + block_row * n_block_cols + block_col, scale)'

def make(qfn):
    """A kernel of this template with its block quantizer ``qfn`` (a module global, so that
    Triton's interpreter resolves it too)."""
    return _instantiate(_make_SRC, qfn)

_make_tma_SRC = '@triton.jit\ndef grouped_tma(desc_ptr, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr):\n    block = tl.program_id(0)\n    d = desc_ptr + tl.program_id(1) * 8\n    rows = tl.load(d + 3)\n    n_block_cols = tl.load(d + 7)\n    if block < tl.cdiv(rows, BLOCK_SIZE) * n_block_cols:\n        x_ptr = tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16)\n        q_ptr = tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16)\n        s_ptr = tl.load(d + 2).to(tl.pointer_type(tl.float32))\n        cols = tl.load(d + 4).to(tl.int32)\n        stride_x = tl.multiple_of(tl.load(d + 5), 16)\n        stride_q = tl.multiple_of(tl.load(d + 6), 16)\n        block_row = block // n_block_cols\n        block_col = block % n_block_cols\n        xd = tl.make_tensor_descriptor(x_ptr, shape=[rows.to(tl.int32), cols], strides=[stride_x, 1], block_shape=[BLOCK_SIZE, BLOCK_SIZE])\n        qd = tl.make_tensor_descriptor(q_ptr, shape=[rows.to(tl.int32), cols], strides=[stride_q, 1], block_shape=[BLOCK_SIZE, BLOCK_SIZE])\n        x = xd.load([(block_row * BLOCK_SIZE).to(tl.int32), (block_col * BLOCK_SIZE).to(tl.int32)])\n        q, scale = qfn(x)\n        qd.store([(block_row * BLOCK_SIZE).to(tl.int32), (block_col * BLOCK_SIZE).to(tl.int32)], q)\n        tl.store(s_ptr + block_row * n_block_cols + block_col, scale)'

def make_tma(qfn):
    """A kernel of this template with its block quantizer ``qfn`` (a module global, so that
    Triton's interpreter resolves it too)."""
    return _instantiate(_make_tma_SRC, qfn)

_make_persistent_SRC = '@triton.jit\ndef persistent(desc_ptr, tile_piece_ptr, rounds, n_programs, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr):\n    for i in tl.range(0, rounds, num_stages=NUM_STAGES):\n        t = tl.program_id(0) + i * n_programs\n        d = desc_ptr + tl.load(tile_piece_ptr + t).to(tl.int64) * 8\n        x_ptr = tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16)\n        q_ptr = tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16)\n        s_ptr = tl.load(d + 2).to(tl.pointer_type(tl.float32))\n        rows = tl.load(d + 3).to(tl.int32)\n        cols = tl.multiple_of(tl.load(d + 4).to(tl.int32), 16)\n        stride_x = tl.multiple_of(tl.load(d + 5).to(tl.int32), 16)\n        stride_q = tl.multiple_of(tl.load(d + 6).to(tl.int32), 16)\n        packed = tl.load(d + 7)\n        n_block_cols = (packed & 0xFFFFFFFF).to(tl.int32)\n        block = t - (packed >> 32).to(tl.int32)\n        block_row = block // n_block_cols\n        block_col = block % n_block_cols\n        r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]\n        c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]\n        mask = (r < rows) & (c < cols)\n        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)\n        q, scale = qfn(x)\n        tl.store(q_ptr + r * stride_q + c, q, mask=mask)\n        tl.store(s_ptr + block_row * n_block_cols + block_col, scale, mask=block_row * BLOCK_SIZE < rows)'

def make_persistent(qfn):
    """A kernel of this template with its block quantizer ``qfn`` (a module global, so that
    Triton's interpreter resolves it too)."""
    return _instantiate(_make_persistent_SRC, qfn)

_make32_SRC = '@triton.jit\ndef grouped32(desc_ptr, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr):\n    block = tl.program_id(0)\n    d = desc_ptr + tl.program_id(1) * 8\n    rows = tl.load(d + 3).to(tl.int32)\n    n_block_cols = tl.load(d + 7).to(tl.int32)\n    if block < tl.cdiv(rows, BLOCK_SIZE) * n_block_cols:\n        x_ptr = tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16)\n        q_ptr = tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16)\n        s_ptr = tl.load(d + 2).to(tl.pointer_type(tl.float32))\n        cols = tl.multiple_of(tl.load(d + 4).to(tl.int32), 16)\n        stride_x = tl.multiple_of(tl.load(d + 5).to(tl.int32), 16)\n        stride_q = tl.multiple_of(tl.load(d + 6).to(tl.int32), 16)\n        block_row = block // n_block_cols\n        block_col = block % n_block_cols\n        r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]\n        c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]\n        mask = (r < rows) & (c < cols)\n        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)\n        q, scale = qfn(x)\n        tl.store(q_ptr + r * stride_q + c, q, mask=mask)\n        tl.store(s_ptr + block_row * n_block_cols + block_col, scale)'

def make32(qfn):
    """A kernel of this template with its block quantizer ``qfn`` (a module global, so that
    Triton's interpreter resolves it too)."""
    return _instantiate(_make32_SRC, qfn)


def derive(template_src, **replacements):
    """A template with text replaced (for cache-modifier variants)."""
    for old, new in replacements.items():
        assert old in template_src, old
        template_src = template_src.replace(old, new)
    return template_src


def make_from(src, qfn):
    return _instantiate(src, qfn)
