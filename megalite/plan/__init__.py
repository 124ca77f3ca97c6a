"""The planner: pure arithmetic on a model (GPTConfig) and a run (RunConfig); no torch.

    estimate(model, cfg)                 per-rank memory, communication, bubble, FLOPs (per_rank.py)
    estimate_model_states(n, cfg)        model states from a parameter count (the ZeRO paper's accounting)
    preflight(model, cfg, world_size)    every configuration error with its fix (validity.py)
    suggest(model, gpus, gpu_memory)     layouts that fit, ranked by step_time() (ranking.py)
    predict_step_time(model, cfg, hw)    seconds per step by part on a hardware profile (timing.py,
                                         hardware.py: built-in A100-80GB, H100-SXM, H200, or a calibrated file)

Module by module: layout.py (blocks per stage), params.py (parameters per rank, FLOPs),
activations.py (saved-activation bytes), communication.py (bytes per group and op).
`tools/plan.py` is its command line. Names load lazily (PEP 562).
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.plan.activations": ["activation_bytes", "embedding_inflight_microbatches", "inflight_microbatches",
                                  "layer_activation_bytes"],
    "megalite.plan.communication": ["bus_factor", "communication_bytes"],
    "megalite.plan.per_rank": ["Estimate", "estimate", "estimate_model_states", "model_state_bytes"],
    "megalite.plan.layout": ["DTYPE_BYTES", "GB", "recompute_fraction", "recomputed_stage_layers", "stage_layers"],
    "megalite.plan.params": ["hardware_flops_per_token", "layer_params", "stage_params"],
    "megalite.plan.validity": ["preflight"],
    "megalite.plan.ranking": ["Suggestion", "justify", "step_time", "suggest"],
    "megalite.plan.hardware": ["BUILTIN", "HardwareProfile", "load_profile"],
    "megalite.plan.timing": ["Kernels", "MEGALITE", "MEGATRON_2021", "StepTime", "predict_step_time"],
})
