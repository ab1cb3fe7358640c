"""``quantization`` (and ``bnb_quant_type``) -> the method the loader uses.

Two steps, as ``EngineArgs.create_engine_config`` needs them: ``check_quantization_name``
before the model is resolved (an unknown name fails without touching the model), then
``resolve_quantization`` against the checkpoint's ``quantization_config``. A pre-quantized
checkpoint decides its own method; asking for another is an error that names the one to
pass. Names are vLLM's.
"""

from __future__ import annotations

from pagedlm.config import ArchConfig

FP8_NAMES = ("fp8", "compressed-tensors")
"""Values of ``quantization`` meaning FP8 weights (vLLM's names)."""
FP8_CHECKPOINT_NAMES = ("modelopt",)
"""Methods that name how an FP8 checkpoint was saved (NVIDIA ModelOpt's); not for
quantizing a float checkpoint at load."""


def check_quantization_name(quantization: str | None, bnb_quant_type: str) -> None:
    """Fails on an unknown method or bitsandbytes type, and when bitsandbytes is asked
    for but not installed."""
    from pagedlm.model_executor.quantization.int_formats import (
        INT_CHECKPOINT_METHODS,
        METHOD_ALIASES,
    )

    known = (
        None, "bitsandbytes", *FP8_NAMES, *FP8_CHECKPOINT_NAMES, *INT_CHECKPOINT_METHODS,
        *METHOD_ALIASES,
    )  # fmt: skip
    if quantization not in known:
        raise ValueError(
            f"quantization={quantization!r} is not supported; use None, "
            "'bitsandbytes' or 'fp8' (or 'gptq', 'awq' for checkpoints quantized so)."
        )
    if quantization == "bitsandbytes":
        from pagedlm.model_executor.loader.bitsandbytes import (
            BNB_QUANT_TYPES,
            import_bitsandbytes,
        )

        if bnb_quant_type not in BNB_QUANT_TYPES:
            raise ValueError(
                f"bnb_quant_type={bnb_quant_type!r} is unknown; use one of "
                f"{', '.join(BNB_QUANT_TYPES)}."
            )
        import_bitsandbytes()


def resolve_quantization(
    quantization: str | None, bnb_quant_type: str, arch: ArchConfig
) -> tuple[str | None, str]:
    """The method and bitsandbytes type to load with: the requested ones, or those a
    pre-quantized checkpoint was saved with."""
    from pagedlm.model_executor.quantization.int_formats import (
        INT_CHECKPOINT_METHODS,
        METHOD_ALIASES,
        int_checkpoint_scheme,
    )

    asked = METHOD_ALIASES.get(quantization or "", quantization)
    if "quantization_config" not in arch.raw:
        if asked in (*INT_CHECKPOINT_METHODS, *FP8_CHECKPOINT_NAMES):
            raise ValueError(
                f"quantization={quantization!r} needs a checkpoint quantized that way "
                "(its config.json has a quantization_config); to quantize a float "
                "checkpoint at load use quantization='fp8' or 'bitsandbytes'."
            )
        return ("fp8" if quantization in FP8_NAMES else quantization), bnb_quant_type
    from pagedlm.model_executor.loader.bitsandbytes import (
        checkpoint_quant_type,
        import_bitsandbytes,
    )
    from pagedlm.model_executor.quantization.fp8_checkpoint import fp8_checkpoint_scheme

    int_scheme = int_checkpoint_scheme(arch.raw)  # refuses variants it cannot read
    if int_scheme is not None:
        if asked not in (None, int_scheme.method):
            raise ValueError(
                f"The checkpoint is quantized with {int_scheme.method!r} but "
                f"quantization={quantization!r} was asked for; drop --quantization "
                f"or pass {int_scheme.method!r}."
            )
        return int_scheme.method, bnb_quant_type
    from pagedlm.model_executor.quantization.int8_checkpoint import int8_checkpoint_scheme

    if int8_checkpoint_scheme(arch.raw) is not None:  # loaded as float weights
        if quantization not in (None, "fp8", "compressed-tensors"):
            raise ValueError(
                "The checkpoint holds int8 weights (compressed-tensors), which load as "
                f"float weights; quantization={quantization!r} does not apply. "
                "Drop --quantization, or pass 'fp8' to store them in FP8."
            )
        return ("fp8" if quantization == "fp8" else None), bnb_quant_type
    fp8_scheme = fp8_checkpoint_scheme(arch.raw)  # refuses FP8 variants it cannot read
    if fp8_scheme is not None:
        saved_method = arch.raw["quantization_config"].get("quant_method")
        if quantization not in (None, "fp8", fp8_scheme.method, saved_method):
            raise ValueError(
                f"The checkpoint is quantized with {fp8_scheme.method!r} (FP8) but "
                f"quantization={quantization!r} was asked for; drop --quantization "
                "or pass 'fp8'."
            )
        return "fp8", bnb_quant_type
    saved = checkpoint_quant_type(arch.raw)
    if saved is None:
        method = arch.raw["quantization_config"].get("quant_method")
        if arch.architecture == "GptOssForCausalLM":
            from pagedlm.model_executor.models.gpt_oss import refuse_mxfp4

            refuse_mxfp4(arch)  # names the bf16 conversions to use instead
        raise ValueError(
            f"The checkpoint is quantized with {method!r}, which pagedlm cannot load; it "
            "loads float checkpoints, bitsandbytes ones (or quantization='bitsandbytes'), "
            "FP8 ones ('fp8', 'compressed-tensors'), GPTQ, AWQ and integer "
            "compressed-tensors ones."
        )
    import_bitsandbytes()
    return "bitsandbytes", saved
