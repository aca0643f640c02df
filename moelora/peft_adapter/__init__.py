"""The parts of :mod:`moelora.peft_loader`, split by concern (import the public names from there).

- :mod:`.messages`: how refusals are worded (file, key, reason) and untrusted values shown.
- :mod:`.paths`: the adapter directory, its file names and the checks of a path.
- :mod:`.formats`: PEFT's key names and the F1 / F2 formats, :class:`.formats.ExpertParamLayout`.
- :mod:`.config`: ``adapter_config.json``: ranks, alphas, patterns, rsLoRA, refused options.
- :mod:`.safetensors_file`: the safetensors header, checked, and zero-copy views of the file's bytes.
- :mod:`.keys`: sorting a file's keys into expert LoRA pairs (F1 / F2) and ignored keys.
- :mod:`.fused`: the fused-parameter (F2) layout: which parameter each wrapper adapts, its orientation.
- :mod:`.validation`: checks of the tensor values, zero rank components, the load report, arena bytes.
- :mod:`.assembly`: the steps of :func:`moelora.peft_loader.read_peft_adapter` between its file reads.
- :mod:`.describe`: :func:`moelora.peft_loader.describe_peft_adapter`, an adapter without model sizes.
"""
