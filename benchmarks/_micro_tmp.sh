export PYTHONPATH=.
python benchmarks/micro_lora.py --model qwen3-30b-a3b --M 1024 --rank 16 --adapters 1 --no-sweep 2>&1 | grep -v regs
python benchmarks/micro_lora.py --model deepseek-v2-lite --M 64 1024 --rank 16 --adapters 1 --no-sweep 2>&1 | grep -v regs
