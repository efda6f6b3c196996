set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/gpu.txt
cmake -S . -B build-gpu -G Ninja -DINDEXCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release -DINDEXCP_SHARED_DIR=$PWD/shared > $OUT/cmake.log 2>&1 || { tail -30 $OUT/cmake.log; exit 1; }
time ninja -C build-gpu -j16 > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
( time build-gpu/bin/indexcp run --backend cuda --json $OUT/run_cuda.json ) > $OUT/run_cuda.txt 2>&1; echo "run rc=$?"; cat $OUT/run_cuda.txt | grep -v "^indexcp run: \[" 
python3 tools/make_example_case.py /tmp/case --tp 4 && build-gpu/bin/indexcp replay /tmp/case --out /tmp/out --scores --backend cuda; echo "replay rc=$?"
python3 tools/make_example_case.py /tmp/case2 --tp 2 --page-size 256 2>&1 | tail -1; build-gpu/bin/indexcp replay /tmp/case2 --out /tmp/out2 --backend cuda; echo "replay2 rc=$?"
cp /tmp/out/report.json $OUT/replay_report.json
( cd build-gpu && OMP_WAIT_POLICY=passive ctest -j8 -LE slow 2>&1 | tail -5 ) | tee $OUT/ctest.txt
