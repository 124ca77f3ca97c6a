"""tools/profile_step.py: kernel names fall in the categories its table reports, and the script runs
end to end on CPU (aten ops by self CPU time) with its GOAL line."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_kernel_names_fall_in_their_categories(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    spec = importlib.util.spec_from_file_location("profile_step", TOOLS / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "profile_step", module)
    spec.loader.exec_module(module)
    expected = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "GEMM",
                "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "GEMM", "aten::mm": "GEMM",
                "_attention_dkdv_kernel": "attention", "_attention_dq_kernel": "attention",
                "_grouped_mm_weight_grad_kernel": "GEMM", "_gather_rows_kernel": "MoE permute",
                "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
                "_softmax_stats_kernel": "cross entropy", "_adamw_kernel": "optimizer",
                "_rms_norm_backward_kernel": "norm", "_column_sum_kernel": "norm", "_swiglu_forward_kernel": "pointwise",
                "Memcpy DtoD (Device -> Device)": "copy / fill", "some_new_kernel": "other"}
    assert {name: module.category(name) for name in expected} == expected


@pytest.mark.slow
def test_cpu_run_lists_aten_ops_and_prints_its_goal():
    result = subprocess.run([sys.executable, str(TOOLS / "profile_step.py"), "--model", "tiny-llama", "--seq-length",
                             "32", "--micro-batch-size", "1", "--warmup", "1", "--steps", "1", "--top", "5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eager: aten ops, self CPU time" in result.stdout and "aten::mm" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("GOAL profile_step tiny-llama: none")]
