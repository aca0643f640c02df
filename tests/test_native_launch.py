"""The native launcher of launch traces (``triton_ops.native_launch``): how a trace's launches become a plan
of 64-bit words, which binaries it refuses (they keep Triton's launcher), and the compiled extension's
refusal of a malformed plan before it launches anything. Its launches themselves are checked on the GPU
(``test_launch_trace``: replays through it equal eager calls bit for bit)."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest

from triton_ops import native_launch
from triton_ops.launch import LaunchTrace, _TracedLaunch


def _binary(signature, **metadata):
    fields = dict(num_ctas=1, launch_cooperative_grid=False, global_scratch_size=0, profile_scratch_size=0,
                  tensordesc_meta=None, shared=1024, num_warps=4, launch_pdl=False)
    fields.update(metadata)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**fields),
                           function=0xABC)


def _words(plan: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(plan) // 8}Q", plan))


def test_plan_layout():
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "scale": "fp32",
                 "flag": "i1", "offset": "i64", "none_ptr": "*i32", "half": "bf16"}
    args = [0, 0, -3, 64, 0.5, True, -(2**40), None, 1.5]
    binary = _binary(signature, launch_pdl=True, num_warps=8, shared=4096)
    # x_ptr from source 2 at byte offset 16, out_ptr from source 0 at 0.
    plan = native_launch.build_plan([(binary, (5, 2, 1), args, [(0, 2, 16), (1, 0, 0)])])
    words = _words(plan)
    assert words[0] == 1
    # Header: function, grid, 32 x num_warps threads, shared bytes, PDL flag, 10 argument words, 2 patches.
    assert words[1:10] == [0xABC, 5, 2, 1, 256, 4096, 1, 10, 2]
    # The constexpr takes no word; two scratch words (none) end the arguments. Pointers start at 0.
    assert words[10:20] == [
        0, 0,
        2**64 - 3,  # -3: its low 32 bits are the int32 the kernel reads
        struct.unpack("<I", struct.pack("<f", 0.5))[0],
        1,
        2**64 - 2**40,
        0,  # the None pointer
        struct.unpack("<I", struct.pack("<f", 1.5))[0] >> 16,  # bf16: the float's high half
        0, 0,
    ]
    # Patches: (argument word, source, byte offset).
    assert words[20:] == [0, 2, 16, 1, 0, 0]


def test_plan_of_several_launches_concatenates():
    binary = _binary({"a": "*fp16", "n": "i32"})
    one = _words(native_launch.build_plan([(binary, (1, 1, 1), [0, 7], [(0, 0, 0)])]))
    two = _words(native_launch.build_plan([(binary, (1, 1, 1), [0, 7], [(0, 0, 0)])] * 2))
    assert two[0] == 2 and two[1:] == one[1:] * 2


@pytest.mark.parametrize("refused", [
    dict(metadata=dict(num_ctas=2)),  # clusters
    dict(metadata=dict(launch_cooperative_grid=True)),
    dict(metadata=dict(global_scratch_size=128)),  # scratch Triton's launcher would allocate
    dict(metadata=dict(profile_scratch_size=64)),
    dict(metadata=dict(tensordesc_meta=[object()])),
    dict(metadata=dict(shared=229 * 1024)),  # needs the oversized shared memory mode
    dict(signature={"a": "*fp16", "d": "tensordesc<fp16[16, 16]>"}),
    dict(signature={"a": "*fp16", "t": ("i32", "i32")}),  # a tuple kind given a scalar
    dict(signature={"a": "*fp16", "t": ("i32", "tensordesc<fp16[16, 16]>")}, args=[0, (1, object())]),
    dict(args=[object(), 3]),  # a pointer that is neither recorded nor an integer
    dict(signature={"a": "*fp16"}),  # argument count differs from the signature
])
def test_binaries_the_plan_refuses(refused):
    signature = refused.get("signature", {"a": "*fp16", "n": "i32"})
    args = refused.get("args", [0, 3])
    binary = _binary(signature, **refused.get("metadata", {}))
    pointers = [] if "args" in refused else [(0, 0, 0)]
    assert native_launch.build_plan([(binary, (1, 1, 1), args, pointers)]) is None


def test_tuple_arguments_flatten_in_order():
    """An operand's bundle (a tuple argument: pointer, table, strides) becomes its items' words in order,
    its constexprs left out; a pointer inside it is patched by its path of indices."""
    signature = {"lora": ("*bf16", "*i32", "i32", "constexpr"), "n": "i32", "CFG": "constexpr",
                 "nested": (("*fp32", "i64"), "i32")}
    args = [(0, 0, 5, 16), 7, (8, True), ((0, 2**33), 9)]
    binary = _binary(signature)
    pointers = [((0, 0), 1, 32), ((0, 1), 0, 0), ((3, 0, 0), 2, 8)]
    words = _words(native_launch.build_plan([(binary, (1, 1, 1), args, pointers)]))
    assert words[8:10] == [7 + 2, 3]  # argument words (and the two scratch words), patches
    assert words[10:19] == [0, 0, 5, 7, 0, 2**33, 9, 0, 0]
    assert words[19:] == [0, 1, 32, 1, 0, 0, 4, 2, 8]  # (argument word, source, byte offset)


def test_too_many_arguments_refused():
    count = native_launch.MAX_ARGUMENT_WORDS - 1  # plus the two scratch words: one too many
    binary = _binary({f"n{i}": "i32" for i in range(count)})
    assert native_launch.build_plan([(binary, (1, 1, 1), [1] * count, [])]) is None
    binary = _binary({f"n{i}": "i32" for i in range(count - 1)})
    assert native_launch.build_plan([(binary, (1, 1, 1), [1] * (count - 1), [])]) is not None


def test_trace_sources_fold_buffer_offsets():
    """The native replay's bases are the inputs, the intermediate buffer's start and the output: a pointer
    into the second intermediate gets that buffer's offset added."""
    launch = _TracedLaunch(binary=None, grid=(1, 1, 1), args=[0, 0, 0, 0],
                           pointers=((0, 1, 8), (1, 2, 0), (2, 3, 4), (3, 4, 0)))
    trace = LaunchTrace.__new__(LaunchTrace)
    trace.num_inputs, trace.buffer_offsets = 2, [0, 1024]
    assert trace._native_sources(launch) == [(0, 1, 8), (1, 2, 0), (2, 2, 1028), (3, 3, 0)]


def test_extension_refuses_malformed_plans(tmp_path, monkeypatch):
    """Checked before the driver is opened: these raise ValueError here, where there is no libcuda."""
    monkeypatch.setenv("MOELORA_CACHE_DIR", str(tmp_path))
    module = native_launch.load()
    assert module is not None, "the extension builds with the C compiler Triton needs"
    binary = _binary({"a": "*fp16", "n": "i32"})
    good = native_launch.build_plan([(binary, (1, 1, 1), [0, 7], [(0, 1, 0)])])
    bad_plans = [
        (b"", (0, 0)),  # no launch count
        (good + b"\0", (0, 0)),  # not whole words
        (good[:-8], (0, 0)),  # cut short
        (good + struct.pack("<Q", 0), (0, 0)),  # words past the last launch
        (good, (0,)),  # a patch names base 1 of 1
        (good[:8 * 8] + struct.pack("<2Q", 200, 0) + b"\0" * 8 * 200, (0, 0)),  # past the argument limit
        (good, tuple(range(65))),  # more bases than the extension takes
    ]
    for plan, bases in bad_plans:
        with pytest.raises(ValueError, match="malformed plan|too many base"):
            module.replay(plan, bases, 0)
    words = _words(good)
    words[-3] = 4  # the patch's argument word: there are 4 (pointer, 7, two scratch)
    with pytest.raises(ValueError, match="malformed plan"):
        module.replay(struct.pack(f"<{len(words)}Q", *words), (0, 0), 0)
    with pytest.raises(TypeError):
        module.replay(good, [0, 0], 0)  # bases must be a tuple


def test_switch(monkeypatch):
    monkeypatch.setenv("MOELORA_NATIVE_LAUNCH", "0")
    assert not native_launch.enabled()
    monkeypatch.setenv("MOELORA_NATIVE_LAUNCH", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        native_launch.enabled()
