"""gpt-oss loaded with MXFP4 experts (transformers' ``Mxfp4GptOssExperts``, packed for its hub kernels):
``attach`` serves them packed (the GEMMs decode the blocks; the torch path a copy decoded once), or
dequantized once with ``dequantize_mxfp4=True``, equal to PEFT on the same weights in bf16 storage.

The hub kernels are not installed here, so the packed module holds stand-ins for the hub's tensors: the
packed bytes and scales behind ``storage.data`` with a strided (identity) layout, as transformers'
``swizzle_mxfp4_convertops`` leaves them and its ``Mxfp4ReverseDeserialize`` reads them back. The FP4 codes
and the power-of-two scales are drawn at random and decoded here, independently of transformers, into
the reference model's bf16-storage experts: every value is exact in fp32, so the check is to 1e-4.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peft_oracle import fill_lora, left_padded, rel_err  # noqa: E402

from moelora.integrations import MoELoRAExperts, UnsupportedModelError, attach  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
if not hasattr(mxfp4, "Mxfp4GptOssMLP"):  # older transformers route MXFP4 experts through hub kernels only
    pytest.skip("this transformers has no Mxfp4GptOssMLP", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:transformers",
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)

# E2M1: codes 0-7 positive, 8-15 the same magnitudes negative.
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
ADAPTERS = {"a": dict(r=4, lora_alpha=8), "b": dict(r=8, lora_alpha=8, use_rslora=True)}
ROWS = ["a", None, "b"]
ROW_LENS = [6, 4, 6]  # left padded to 6
REL_TOL = {"cpu": 1e-4, "cuda": 1e-3}  # fp32 on CUDA: the Triton kernels against PEFT's CUDA forward


def _config():
    # H and I multiples of MXFP4's 32-value blocks; E=8 (some experts no token picks), top-2.
    return transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, swiglu_limit=1.0,
        max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _random_mxfp4(rows: int, cols: int, experts: int, gen: torch.Generator):
    """Packed ``(E, rows, cols/32, 16)`` uint8 blocks (low nibble = even column), ``(E, rows, cols/32)``
    biased-127 exponents, and the values they encode, ``(E, rows, cols)`` fp32."""
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    exponents = torch.randint(120, 125, (experts, rows, cols // 32), generator=gen)  # 2^-7 .. 2^-3
    values = FP4[codes] * torch.exp2(exponents.float() - 127).repeat_interleave(32, dim=-1)
    pairs = codes.reshape(experts, rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, exponents.to(torch.uint8), values


class _HubTensor:
    """What transformers' reverse conversion reads of a hub tensor with a strided layout."""

    def __init__(self, data: torch.Tensor) -> None:
        self.storage = SimpleNamespace(data=data, layout=SimpleNamespace(unswizzle_data=lambda d: d))


def _pack(experts: nn.Module, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Sets ``proj`` of an ``Mxfp4GptOssExperts`` as ``swizzle_mxfp4_convertops`` does: the hub tensor of the
    blocks and scales (transposed, as the hub takes them) in place of the parameter."""
    rows = blocks.shape[1]
    del experts._parameters[proj]
    setattr(experts, proj, _HubTensor(blocks.reshape(blocks.shape[0], rows, -1).transpose(-2, -1)))
    setattr(experts, f"{proj}_precision_config",
            SimpleNamespace(weight_scale=_HubTensor(scales.transpose(-2, -1))))


def _reference():
    """A gpt-oss model whose experts hold decoded random MXFP4 values, and per layer the packed tensors
    (gate_up blocks, gate_up scales, down blocks, down scales) that encode them."""
    cfg = _config()
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(5)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    packed_tensors = []
    for layer_ref in ref.model.layers:
        experts = layer_ref.mlp.experts
        gu_blocks, gu_scales, gu = _random_mxfp4(2 * i, h, e, gen)  # (E, 2I, H): interleaved gate/up rows
        d_blocks, d_scales, down = _random_mxfp4(h, i, e, gen)  # (E, H, I)
        with torch.no_grad():
            layer_ref.mlp.router.weight.copy_(torch.randn(e, h, generator=gen) * 0.5)
            experts.gate_up_proj.copy_(gu.transpose(1, 2))
            experts.down_proj.copy_(down.transpose(1, 2))
            experts.gate_up_proj_bias.copy_(torch.randn(e, 2 * i, generator=gen) * 0.2)
            experts.down_proj_bias.copy_(torch.randn(e, h, generator=gen) * 0.2)
        packed_tensors.append((gu_blocks, gu_scales, d_blocks, d_scales))
    ref.generation_config.pad_token_id = 0
    ref.generation_config.eos_token_id = None
    return ref, packed_tensors


def _write_checkpoint(directory: Path, *, drop: str | None = None, shards: int = 2) -> Path:
    """The reference model saved as gpt-oss checkpoints are: its experts as MXFP4 ``*_blocks`` and
    ``*_scales`` (no dense expert weights), ``quantization_config`` mxfp4, in ``shards`` safetensors files
    with an index. ``drop``: a key left out."""
    import json

    from safetensors.torch import save_file

    ref, packed_tensors = _reference()
    state = {k: v.contiguous() for k, v in ref.state_dict().items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for n, tensors in enumerate(packed_tensors):
        names = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        for name, t in zip(names, tensors, strict=True):
            state[f"model.layers.{n}.mlp.experts.{name}"] = t.contiguous()
    state.pop(drop, None)
    directory.mkdir(parents=True, exist_ok=True)
    ref.config.save_pretrained(directory)
    ref.generation_config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[shard::shards]}
        save_file(part, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _models(device: str, tmp_path: Path | None = None):
    """(reference gpt-oss model with the decoded experts, the same model with MXFP4-packed experts): the
    hub module's stand-ins, or with ``tmp_path`` the checkpoint written there loaded by
    ``load_packed_gpt_oss``."""
    ref, packed_tensors = _reference()
    if tmp_path is not None:
        from moelora.integrations.gpt_oss import load_packed_gpt_oss

        packed = load_packed_gpt_oss(_write_checkpoint(tmp_path / "checkpoint"), device, torch.float32)
        return ref.to(device), packed
    cfg = ref.config
    packed = copy.deepcopy(ref)
    for layer_ref, layer_packed, tensors in zip(ref.model.layers, packed.model.layers, packed_tensors,
                                                strict=True):
        experts = layer_ref.mlp.experts
        gu_blocks, gu_scales, d_blocks, d_scales = tensors
        hub = mxfp4.Mxfp4GptOssExperts(cfg)
        _pack(hub, "gate_up_proj", gu_blocks, gu_scales)
        _pack(hub, "down_proj", d_blocks, d_scales)
        with torch.no_grad():
            hub.gate_up_proj_bias.copy_(experts.gate_up_proj_bias)
            hub.down_proj_bias.copy_(experts.down_proj_bias)
        router = copy.deepcopy(layer_ref.mlp.router)
        layer_packed.mlp = mxfp4.Mxfp4GptOssMLP(router, hub)
    return ref.to(device), _move_packed(packed, device)


def _move_packed(model: nn.Module, device: str) -> nn.Module:
    model.to(device)  # the hub tensors are not parameters: moved by hand
    for module in model.modules():
        if isinstance(module, mxfp4.Mxfp4GptOssExperts):
            for proj in ("gate_up_proj", "down_proj"):
                data = getattr(module, proj).storage.data.to(device)
                scales = getattr(module, f"{proj}_precision_config").weight_scale.storage.data.to(device)
                setattr(module, proj, _HubTensor(data))
                getattr(module, f"{proj}_precision_config").weight_scale = _HubTensor(scales)
    return model


def _check_served(device: str, tmp_path: Path, *, dequantize: bool = False, path: str | None = None,
                  checkpoint: bool = False) -> None:
    ref, packed = _models(device, tmp_path if checkpoint else None)
    ids, mask = (t.to(device) for t in left_padded(ROW_LENS, 96))
    tol = REL_TOL[device]
    oracles = {None: ref}
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        pm = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
            target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"], **cfg))
        fill_lora(pm, seed=100 + seed)
        pm.eval().save_pretrained(str(tmp_path / name))
        oracles[name] = pm
    keys_before = list(packed.state_dict())
    hubs = [layer.mlp.experts for layer in packed.model.layers]

    path = path or ("torch" if device == "cpu" else "auto")
    handle = attach(packed, max_loras=2, max_rank=8, path=path, dequantize_mxfp4=dequantize)
    try:
        assert list(packed.state_dict()) == keys_before  # the packed module's parameters, not the copies
        assert all(isinstance(layer.mlp.experts, MoELoRAExperts) for layer in packed.model.layers)
        served = [layer.mlp.experts.layer for layer in packed.model.layers]
        # Packed: the layer reads uint8 blocks (no bf16 copy); dequantized: a dense copy.
        assert all((s.w13.dtype == torch.uint8) is (not dequantize) for s in served)
        assert all((s.mxfp4 is None) is dequantize for s in served)
        for name in ADAPTERS:
            handle.load_adapter(name, tmp_path / name)
        with torch.no_grad():
            base = packed(input_ids=ids, attention_mask=mask).logits
            assert rel_err(base, ref(input_ids=ids, attention_mask=mask).logits) < tol
            with handle.adapters(ROWS):
                logits = packed(input_ids=ids, attention_mask=mask).logits
                tokens = packed.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                         do_sample=False)
            for row, name in enumerate(ROWS):
                real = slice(max(ROW_LENS) - ROW_LENS[row], None)
                one = slice(row, row + 1)
                want = oracles[name](input_ids=ids[one], attention_mask=mask[one]).logits[0, real]
                assert rel_err(logits[row, real], want) < tol, (name, rel_err(logits[row, real], want))
                if name is not None:  # the adapter changes this row
                    assert rel_err(base[row, real], want) > 1e-2
                want_tokens = oracles[name].generate(input_ids=ids[one], attention_mask=mask[one],
                                                     max_new_tokens=4, do_sample=False)
                assert tokens[row, ids.shape[1]:].tolist() == want_tokens[0, ids.shape[1]:].tolist(), name
    finally:
        handle.detach()
    assert [layer.mlp.experts for layer in packed.model.layers] == hubs  # the packed modules are back
    assert list(packed.state_dict()) == keys_before


SOURCES = pytest.mark.parametrize("checkpoint", [False, True], ids=["hub", "checkpoint"])


@SOURCES
@pytest.mark.parametrize("dequantize", [False, True], ids=["packed", "dequantized"])
def test_mxfp4_experts_match_peft(tmp_path, dequantize, checkpoint):
    _check_served("cpu", tmp_path, dequantize=dequantize, checkpoint=checkpoint)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs Triton kernels on the CPU: set TRITON_INTERPRET=1")
@SOURCES
def test_mxfp4_experts_packed_on_the_kernels_match_peft(tmp_path, checkpoint):
    """The packed experts through the Triton paths (the interpreter): the GEMMs decode the blocks."""
    _check_served("cpu", tmp_path, path="auto", checkpoint=checkpoint)


@pytest.mark.gpu
@SOURCES
@pytest.mark.parametrize("dequantize", [False, True], ids=["packed", "dequantized"])
def test_mxfp4_experts_on_cuda_match_peft(tmp_path, dequantize, checkpoint):
    _check_served("cuda", tmp_path, dequantize=dequantize, checkpoint=checkpoint)


def test_packed_checkpoint_loads_the_experts_as_stored(tmp_path, caplog):
    """``load_packed_gpt_oss``: the experts' parameters are the checkpoint's uint8 blocks and scales, bit
    for bit (no dense expert weight anywhere in the model), the rest is the checkpoint's, and the model
    unattached (its experts decoded per call in PyTorch) computes the reference model's logits. Each file
    read is logged."""
    from safetensors import safe_open

    from moelora.integrations.gpt_oss import PackedGptOssExperts, load_packed_gpt_oss
    from moelora.serve.server import load_model

    directory = _write_checkpoint(tmp_path / "checkpoint")
    with caplog.at_level("INFO", logger="moelora.integrations.gpt_oss"):
        model = load_packed_gpt_oss(directory, "cpu", torch.float32)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "checkpoint: file 1/2 read onto cpu", "checkpoint: file 2/2 read onto cpu"]
    ref, _ = _reference()
    stored = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    state = model.state_dict()
    assert sorted(state) == sorted(stored)
    for key, tensor in stored.items():
        assert state[key].dtype == (torch.uint8 if key.endswith(("_blocks", "_scales")) else torch.float32)
        assert torch.equal(state[key], tensor), key
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(e, PackedGptOssExperts) for e in experts)
    assert not any(p.dtype.is_floating_point and p.dim() == 3 for e in experts for p in e.parameters())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ids, mask = left_padded(ROW_LENS, 96)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got, want) < REL_TOL["cpu"]
    # ``moelora serve DIR`` reads such a checkpoint the same way (here without a tokenizer: refused after)
    with pytest.raises(ValueError, match="finds no tokenizer"):
        load_model(directory, "cpu", torch.float32)
    # In bfloat16 the norms stay float32, as transformers' own loading leaves gpt-oss.
    half = load_packed_gpt_oss(directory, "cpu", torch.bfloat16)
    dtypes = {name: p.dtype for name, p in half.named_parameters()}
    assert dtypes["model.norm.weight"] == dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.experts.gate_up_proj_bias"] == torch.bfloat16


@pytest.mark.parametrize("case", ["no scales", "bad shape", "stray key", "not mxfp4", "missing shard",
                                  "corrupt shard", "bad index", "config a list"])
def test_packed_checkpoint_refusals_name_the_file_and_key(tmp_path, case):
    import json

    from safetensors.torch import load_file, save_file

    from moelora.integrations.gpt_oss import load_packed_gpt_oss

    key = "model.layers.1.mlp.experts.down_proj_scales"
    directory = _write_checkpoint(tmp_path / "checkpoint", drop=key if case == "no scales" else None)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    if case in ("bad shape", "stray key"):
        file = directory / index["weight_map"]["model.norm.weight"]
        part = load_file(str(file))
        if case == "bad shape":
            part["model.norm.weight"] = torch.zeros(3)
        else:
            part["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(2, 2)
        save_file(part, str(file))
    if case == "not mxfp4":
        config = json.loads((directory / "config.json").read_text())
        del config["quantization_config"]
        (directory / "config.json").write_text(json.dumps(config))
    if case == "missing shard":
        next(directory.glob("model-00002-*.safetensors")).unlink()
    if case == "corrupt shard":
        next(directory.glob("model-00002-*.safetensors")).write_bytes(b"not safetensors")
    if case == "bad index":
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    if case == "config a list":
        (directory / "config.json").write_text("[1, 2]")
    words = {"no scales": f"no {key!r}", "bad shape": "'model.norm.weight' has shape (3,), expected (64,)",
             "stray key": "'model.layers.0.mlp.experts.gate_up_proj' is not a parameter",
             "not mxfp4": "not a gpt-oss checkpoint with MXFP4 experts",
             "missing shard": "model-00002-of-00002.safetensors: checkpoint file missing",
             "corrupt shard": "model-00002-of-00002.safetensors: not a readable safetensors file",
             "bad index": "model.safetensors.index.json: not a safetensors index with a weight_map",
             "config a list": "not a gpt-oss checkpoint with MXFP4 experts"}[case]
    with pytest.raises(ValueError, match=re.escape(words)):
        load_packed_gpt_oss(directory, "cpu", torch.float32)


def test_packed_experts_take_their_gate_constants_as_the_installed_gpt_oss_experts(monkeypatch):
    """alpha and limit are read as transformers' own GptOssExperts reads them: from the config where it
    does, and from its own constant where an older version fixes alpha (their configs have no
    ``swiglu_alpha``)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from moelora.integrations.gpt_oss import PackedGptOssExperts

    config = _config()
    config.swiglu_alpha, config.swiglu_limit = 1.25, 3.0
    with torch.device("meta"):
        dense = modeling_gpt_oss.GptOssExperts(config)
    packed = PackedGptOssExperts(config, torch.float32)
    assert (packed.alpha, packed.limit) == (float(dense.alpha), float(dense.limit))

    def older_init(self, config):
        nn.Module.__init__(self)
        self.alpha, self.limit = 1.702, config.swiglu_limit

    monkeypatch.setattr(modeling_gpt_oss.GptOssExperts, "__init__", older_init)
    del config.swiglu_alpha
    packed = PackedGptOssExperts(config, torch.float32)
    assert (packed.alpha, packed.limit) == (1.702, 3.0)


def test_mxfp4_experts_without_their_scales_are_refused():
    """Packed experts whose hub tensors are missing (plain uint8 parameters, no scales: the hub kernels
    never loaded them) cannot be decoded: a refusal that says how to load the model, nothing swapped."""
    cfg = _config()
    model = transformers.GptOssForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = mxfp4.Mxfp4GptOssMLP(layer.mlp.router, mxfp4.Mxfp4GptOssExperts(cfg))
    with pytest.raises(UnsupportedModelError, match=r"MXFP4.*Mxfp4Config\(dequantize=True\)"):
        attach(model, path="torch")
    assert not any(isinstance(m, MoELoRAExperts) for m in model.modules())


def test_mxfp4_experts_outside_their_mlp_are_refused():
    """Packed experts under another MLP (older transformers patch GptOssMLP to route them through the hub
    kernels): swapping them would not be called as an experts module, so attach says no."""
    _, packed = _models("cpu")
    layer = packed.model.layers[0]
    plain = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(packed.config)
    plain.router, plain.experts = layer.mlp.router, layer.mlp.experts
    layer.mlp = plain
    with pytest.raises(UnsupportedModelError, match="not transformers' Mxfp4GptOssMLP"):
        attach(packed, path="torch")
    assert not any(isinstance(m, MoELoRAExperts) for m in packed.modules())


def _save_char_tokenizer(directory: Path) -> None:
    """A tokenizer of one token per character (ids 32-95: space to underscore), saved as transformers saves
    one, so ``AutoTokenizer.from_pretrained(directory)`` loads it as it would a real checkpoint's."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(i): i for i in range(32, 96)} | {"<unk>": 0}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(directory)


def test_moelora_serve_of_a_packed_checkpoint_answers_as_peft(tmp_path):
    """``moelora serve DIR`` on a gpt-oss MXFP4 checkpoint (its tokenizer beside it): ``load_model`` reads
    the experts packed, the server attaches and loads an adapter, and completions over HTTP (the adapter
    and the base) are PEFT's greedy tokens on the reference model."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from moelora.integrations.gpt_oss import PackedGptOssExperts
    from moelora.serve.server import build_server, load_model

    directory = _write_checkpoint(tmp_path / "checkpoint")
    _save_char_tokenizer(directory)
    ref, _ = _reference()
    pm = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"], **ADAPTERS["a"]))
    fill_lora(pm, seed=100)
    pm.eval().save_pretrained(str(tmp_path / "a"))
    model, tokenizer = load_model(directory, "cpu", torch.float32)
    assert all(isinstance(layer.mlp.experts, PackedGptOssExperts) for layer in model.model.layers)
    srv = build_server(model, tokenizer, adapters={"a": tmp_path / "a"}, base_name="gpt-oss-tiny")
    texts = {}
    try:
        for name, oracle in (("a", pm), ("gpt-oss-tiny", ref)):
            prompt = "HELLO MOE"
            reply = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": name, "prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.no_grad():
                want = oracle.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                       do_sample=False)[0, ids.shape[1]:]
            texts[name] = reply["choices"][0]["text"]
            assert texts[name] == tokenizer.decode(want.tolist()), name
    finally:
        srv.stop(cancel=True)
    assert texts["a"] != texts["gpt-oss-tiny"], texts  # the adapter changes the answer
