"""``benchmarks/family_coverage.py`` on every transformers Mixture-of-Experts family (CPU, fp32).

One test per family found in the installed transformers: the script builds the family's tiny random model,
saves two PEFT adapters on its routed experts and checks a mixed, left-padded batch served by
``moelora.integrations.attach`` against PEFT row by row (logits and a greedy ``generate``). The test asserts
the verdict recorded in :data:`EXPECTED`: ``served`` (equal to PEFT) or ``refused`` (attach or
load_adapter said no). A family whose tiny model cannot be built (``no model``) or that fails otherwise
(``error``) has no place here: its tiny config is fixed in the script's ``OVERRIDES`` instead. A family
that transformers adds fails its test until it is given a verdict here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Same filters as tests/test_integrations.py: PEFT 0.21 warns that rank/alpha pattern keys on
# target_parameters match nothing (they do apply); tiny configs trip transformers' vocabulary checks.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys did not match",
    "ignore::UserWarning:transformers",
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)


def _load_script():
    path = ROOT / "benchmarks" / "family_coverage.py"
    spec = importlib.util.spec_from_file_location("family_coverage", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fc = _load_script()

# family -> verdict. Every family builds its tiny model and gets a real verdict; none is in "no model" or
# "error" (the script's OVERRIDES fix the configs the generic shrink does not fit).
SERVED = [
    "afmoe", "aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_ocr2",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffusion_gemma", "dots1",
    "dots3_note", "ernie4_5_moe", "ernie4_5_vl_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe",
    "glm4_moe_lite", "glm4v_moe", "glm5_next", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hy_v4_vl", "inkling",
    "inkling2", "inkling2_loop", "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini",
    "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2",
    "minimax_m3_vl", "mistral4", "mistral_large4", "mixtral", "muse_spark", "nemotron_h", "olmoe",
    "openai_privacy_filter", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "unlimited_ocr", "zaya",
]
REFUSED = {
    # experts kept as flat (E*I, H) matrices w1 / v1 / w2 in one module: no fused 3-D experts
    "dbrx": "stacked 2-D matrices",
    # seq2seq with per-expert nn.Linear experts (nn.ModuleDict of dense blocks)
    "nllb_moe": "no fused routed-experts module",
    "switch_transformers": "no fused routed-experts module",
}
EXPECTED: dict[str, str] = {**dict.fromkeys(SERVED, "served"), **dict.fromkeys(REFUSED, "refused")}
COMMITTED = json.loads((ROOT / "benchmarks" / "results" / "family_coverage.json").read_text())
COMMITTED_TRANSFORMERS = COMMITTED[0]["transformers"]  # the version the verdicts above were found with


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is as fast, and immune to OpenMP spin-waits on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _families() -> list[str]:
    return sorted(set(EXPECTED) | set(fc.discover_families()))


@pytest.mark.parametrize("family", _families())
def test_family(family, tmp_path):
    assert family in fc.discover_families(), f"{family} is no longer a transformers MoE family"
    assert family in EXPECTED, f"{family}: a new transformers MoE family; give it a verdict in EXPECTED"
    result = fc.check_family(family, budget_s=60, workdir=tmp_path)
    assert result.category == EXPECTED[family], (family, result.category, result.detail)
    assert result.experts_class and result.storage
    if result.category == "refused":
        assert REFUSED[family] in result.detail, result.detail


@pytest.mark.gpu
@pytest.mark.parametrize("family", SERVED)
def test_family_on_cuda(family, tmp_path):
    """The same check with the models on CUDA in fp32: every family's layers on the Triton kernels give
    the verdict the PyTorch path gives with the installed transformers (a GPU machine may have another
    version, without some families or with another experts module: the CPU check says what it serves)."""
    if family not in fc.discover_families():
        pytest.skip(f"{family} is not a MoE family of transformers {transformers.__version__}")
    on_cpu = fc.check_family(family, budget_s=120, workdir=tmp_path)
    result = fc.check_family(family, budget_s=120, workdir=tmp_path, device="cuda")
    assert (result.category, on_cpu.category) == ("served", "served") or (
        result.category == on_cpu.category == "refused"), (family, result.detail, on_cpu.detail)
    if transformers.__version__ == COMMITTED_TRANSFORMERS:
        assert result.category == "served", (family, result.detail)


def test_committed_table_holds_these_verdicts():
    """docs/models.md's family table is rendered from benchmarks/results/family_coverage.json: it must say
    what the live checks above find."""
    assert {r["family"]: r["category"] for r in COMMITTED} == EXPECTED
    for r in COMMITTED:
        if r["category"] == "refused":
            assert REFUSED[r["family"]] in r["detail"], r


def test_discovery_finds_the_known_families():
    found = fc.discover_families()
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "nllb_moe", "switch_transformers"} <= set(found)
    assert "NllbMoeExperts" in found["nllb_moe"]
    assert "vitpose_backbone" not in found  # experts chosen by a dataset index, not routed
    assert "llama" not in found  # dense


def test_generic_shrink():
    assert fc._resize_per_layer(["dense"] + ["sparse"] * 9, 3) == ["dense", "sparse", "sparse"]
    assert fc._resize_per_layer(["sliding"] * 5 + ["full"], 2) == ["sliding", "full"]
    assert fc._split_evenly(4, [16, 24, 24]) == [1, 2, 1]  # mrope sections for 4 rotary frequencies
    assert fc._split_evenly(2, [16, 24, 24]) == [0, 1, 1]
    shrunk = fc._shrink_dict({"num_hidden_layers": 40, "hidden_size": 4096, "num_experts": 256,
                              "num_experts_per_tok": None, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 37,
                              "qk_rope_head_dim": 0, "zero_expert_num": 256}, 3)
    assert shrunk == {"num_hidden_layers": 3, "hidden_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                      "mlp_layer_types": ["dense", "sparse", "sparse"], "zero_expert_num": 2}


def test_storage_descriptions():
    gpt = fc.build_tiny_model("gpt_oss").model
    desc = fc.describe_storage(gpt.model.layers[0].mlp.experts)
    assert desc.startswith("fused transposed (E,H,2I)/(E,I,H)") and "interleaved gate/up" in desc
    assert "+bias" in desc
    nllb = fc.build_tiny_model("nllb_moe").model
    desc = fc.describe_storage(nllb.model.encoder.layers[0].ffn.experts)
    assert desc.startswith("per-expert modules (nn.ModuleDict of 8 NllbMoeDenseActDense: fc1/fc2)")


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert fc.main(["--families", "olmoe,dbrx", "--json", str(out), "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert "| family | experts class | storage | result | detail |" in printed
    assert "1 of 2 families served and equal to PEFT" in printed
    rows = json.loads(out.read_text())
    assert [(r["family"], r["category"]) for r in rows] == [("olmoe", "served"), ("dbrx", "refused")]
    assert all(r["transformers"] == transformers.__version__ and r["peft"] == peft.__version__ for r in rows)
