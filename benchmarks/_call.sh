#!/bin/bash
# session 21 call 23 (scratch): DRAM counters of the copy ring with and without a per-record delay
NCU=${NCU:-/usr/local/cuda/bin/ncu}
ls $NCU >/dev/null 2>&1 || NCU=$(which ncu)
$NCU --query-metrics --chip gh100 2>/dev/null | grep -i -E "^(dram|fbpa|fbp)__" | awk '{print $1}' > $OUT/ncu_dram_metric_names.txt
wc -l < $OUT/ncu_dram_metric_names.txt
cat > /tmp/ring_drv.py <<'PY'
import sys
import torch
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from bench_read_floor import LLAMA8B, Reader, load_lib, w12_bytes
lib = load_lib()
n = w12_bytes(*LLAMA8B["gate_up"])
buf = torch.empty(n, dtype=torch.uint8, device="cuda")
r = Reader(lib, 264, False)
for spin in (0, 500, 0, 500, 1000):
    r.ring(buf, 256, 3, 4, spin, 0, 64)
torch.cuda.synchronize()
PY
python /tmp/ring_drv.py && echo warm-ok
M=$(grep -E "^dram__(bytes_read|sectors_read|throughput|cycles|)" $OUT/ncu_dram_metric_names.txt | head -0)
timeout 400 $NCU --clock-control none --cache-control all -k regex:ring_kernel --launch-skip 2 --launch-count 3 \
  --metrics "gpu__time_duration.sum,regex:^dram__,regex:^fbpa__" python /tmp/ring_drv.py > $OUT/ncu_s21_ring_dram.txt 2>&1
echo rc=$?
grep -E "ring_kernel|duration|dram__bytes_read.sum |dram__throughput|activ|row|page|fbpa__dram_(read|write)_sectors|ERROR|==PROF==" $OUT/ncu_s21_ring_dram.txt | head -60
