export PYTHONPATH=.
python -m pytest -q -m gpu tests -x 2>&1 | tail -2
python benchmarks/micro_lora.py --model qwen3-30b-a3b --M 1024 --rank 16 --adapters 4 --no-sweep 2>&1 | grep -E "M=|shrink|split|base  |spills=[1-9]"
python benchmarks/micro_lora.py --model deepseek-v2-lite --M 64 --rank 16 --adapters 4 --no-sweep 2>&1 | grep -E "M=|shrink|split|base  |spills=[1-9]"
python -m moelora bench --models deepseek-v2-lite qwen3-30b-a3b --M 1 64 256 1024 --ranks 16 --adapters 1 4 --paths base split --no-progress --out $OUT/b3.json 2>&1 | grep split | awk -F'|' '{print $2,$3,$4,$5,$7,$8,$9,$10}'
