#!/usr/bin/env bash
# Dataset v2: every committed tuning log (benchmarks/results/**/*.tar.gz, four machine types), the
# reference dataset, and the collected shards (data/v2/shards/<mcpu>/*.tar.gz), merged and
# deduplicated into one database whose records keep their own machine; then split v2, the
# archive with its manifest, and the stats.
#   data/v2/build.sh WORK_DIR          (run from the repository root)
set -euo pipefail
WORK=${1:?work dir}; CWM=${CWM:-cwm}
rm -rf "$WORK/sources" "$WORK/db"; mkdir -p "$WORK/sources"
i=0
for t in $(find benchmarks/results -name '*.tar.gz' | sort) data/reference/reference_db.tar.gz \
         $(find data/v2/shards -name '*.tar.gz' | sort); do
    i=$((i + 1)); mkdir -p "$WORK/sources/$i"; tar xzf "$t" -C "$WORK/sources/$i"
done
mapfile -t sources < <(find "$WORK/sources" -name database_workload.json -printf '%h\n' | sort)
$CWM dataset merge "${sources[@]}" --db "$WORK/db"
$CWM dataset split --db "$WORK/db" --out data/v2/split_v2.json \
    --test-network mobilenet_v2 --test-network squeezenet1_1 --test-kind conv3d --test-kind conv2d_transpose
$CWM dataset pack --db "$WORK/db" --out data/v2 --archive dataset_v2.tar.gz --split data/v2/split_v2.json
$CWM dataset stats --db "$WORK/db" --plot data/v2/stats.png > data/v2/stats.txt
