#!/usr/bin/env bash
# The demo: a private daemon, the classic two-rank DDP job, its progress rank by rank, a summary.
set -euo pipefail
dir=$(mktemp -d /tmp/ddpd-demo.XXXXXX)
export DDPD_SOCKET="$dir/ddpd.sock"
# a private daemon of whoever runs the demo: root may run its own jobs in it (a system daemon refuses them)
ddpd serve --socket "$DDPD_SOCKET" --state-dir "$dir/state" --log-format json --allow-root-jobs 2>"$dir/daemon.log" &
daemon=$!
cleanup() {
    kill -TERM "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 1 300); do ddpctl ping >/dev/null 2>&1 && break; sleep 0.1; done
ddpctl ping >/dev/null

echo "== submitting the classic two-layer job, 2 ranks (gloo on CPU)"
echo "   (the seed program's model; its loss here is an MSE to a target the model can learn, so it falls"
echo "    as training goes; the seed's own (a+b).sum() only goes negative: --option loss=sum)"
job=$(ddpctl submit --task two-layer --nproc 2 --steps 20 --name demo)
echo "job $job"
echo "== progress, rank by rank"
ddpctl events "$job" -f --since 0 | grep -E 'rank\.(spawned|connected|joined|progress|result|exited)|job\.(state_changed|finished)' || true
echo "== summary"
ddpctl status "$job"
ddpctl wait "$job"
echo "== daemon log (structured, JSON) kept $(wc -l < "$dir/daemon.log") events; the demo daemon stops now"
