#!/usr/bin/env bash
# Dataset v2 collection on this host: one shard database per source (registry operators, then networks),
# each task collected once (--skip-collected over every shard). Resumable: re-run it; a shard that is
# only in its archive is unpacked first. After each source, its shard is archived to DEST/shards/NAME.tar.gz.
#   [SKIP_DBS="DB..."] data/v2/collect.sh WORK_DIR DEST_DIR [RANDOM EVOLUTIONARY]
# SKIP_DBS: further databases whose tasks are not collected again (e.g. the reference dataset).
set -uo pipefail
WORK=${1:?work dir}; DEST=${2:?destination dir}; RANDOM_N=${3:-24}; EVO_N=${4:-24}
CWM=${CWM:-cwm}
mcpu=$(python -c 'from cwm.hardware import make_target; import json; print(json.loads(str(make_target()))["mcpu"])')
SHARDS="$WORK/$mcpu"; OUTS="$DEST/shards/$mcpu"
mkdir -p "$SHARDS" "$OUTS"
SOURCES=(registry distilbert squeezenet1_1 shufflenet_v2_x1_0 mnasnet1_0 vgg11 opt-125m t5-small-encoder
         inception_v3 densenet121 resnext50_32x4d wide_resnet50_2 resnet18-b4 squeezenet1_1-b4 distilbert-s256)
archive() {  # NAME: tar the shard atomically beside the others
    local tmp="$OUTS/.$1.tar.gz.tmp$$"
    tar czf "$tmp" -C "$SHARDS" "$1" && mv "$tmp" "$OUTS/$1.tar.gz"
}
for name in "${SOURCES[@]}"; do
    [ -f "$SHARDS/$name.done" ] && continue
    if [ ! -d "$SHARDS/$name" ] && [ -f "$OUTS/$name.tar.gz" ]; then tar xzf "$OUTS/$name.tar.gz" -C "$SHARDS"; fi
    skip=(); for d in "$SHARDS"/*/ ${SKIP_DBS:-}; do skip+=(--skip-collected "$d"); done
    if [ "$name" = registry ]; then src=(registry); else src=(--network "$name"); fi
    echo "== $name $(date -u +%FT%TZ)"
    if $CWM collect "${src[@]}" --db "$SHARDS/$name" --random "$RANDOM_N" --evolutionary "$EVO_N" "${skip[@]}"; then
        archive "$name" && touch "$SHARDS/$name.done"
    else
        echo "!! $name failed; archived what it has" >&2; archive "$name"
    fi
done
echo "== all sources done $(date -u +%FT%TZ)"
