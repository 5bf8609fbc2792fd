#!/bin/bash
# A simulated worker: speaks ddpd's worker protocol without torch (the daemon-at-scale benchmark).
#
# The daemon runs it in place of `python -m ddpd.worker` when its config sets
# worker_command = ["/bin/bash", ".../benchmarks/simworker.sh", "--protocol", "N"]; the daemon's
# worker arguments follow (--fd N --parent PID). It says hello, waits for its assignment, reports
# the phases up to `training` (without connecting to the store), then sends a Heartbeat carrying a
# step counter every heartbeat interval (one step per beat) and a Progress frame every
# SIMWORKER_PROGRESS_EVERY beats (10). It ends on Stop (Result with stopped_early, exit 0) and at
# once when its channel closes (the daemon is gone: it has no PR_SET_PDEATHSIG, the closed channel
# is what ends it). Cold or pooled (tests/integration/test_pool_hold.py runs it in a warm pool).
#
# A shell, not Python, so that the benchmark measures the daemon and not interpreters starting (a
# bash start is a tenth of the smallest Python one's). Its frames and its reading of the Assign are
# held to the protocol's own types by tests/unit/test_simworker.py.
set -u
protocol="" fd="" parent=""
while (($#)); do
    case $1 in
        --protocol) protocol=$2; shift 2 ;;
        --fd) fd=$2; shift 2 ;;
        --parent) parent=$2; shift 2 ;;
        *) shift ;;
    esac
done
[[ -n $protocol && -n $fd && -n $parent ]] || { echo "simworker: --protocol, --fd and --parent are required" >&2; exit 2; }
[[ $PPID == "$parent" ]] || exit 70
every=${SIMWORKER_PROGRESS_EVERY:-10}
# `read -t` waits with select(), which aborts on an fd past 1023 (a busy daemon's fds are): move the
# channel to the lowest free fd from 10 up
exec {low}<&"$fd" {fd}>&-
fd=$low

send() { printf '%s\n' "$1" >&"$fd"; }

# a top-level number of the Assign: its last "key": (the spec and the environment come first, and a
# quote inside a JSON string is escaped, so no string holds "key": unescaped)
# (into REPLY: no subshell)
number() { local rest=${1##*\"$2\":}; if [[ $rest == "$1" ]]; then REPLY=0; else REPLY=${rest%%[,\}]*}; fi; }

send "{\"type\":\"hello\",\"version\":$protocol,\"pid\":$$,\"python\":\"bash\"}"
while :; do
    IFS= read -r -u "$fd" line || exit 71
    [[ $line == '{"type":"assign"'* ]] && break
done
number "$line" pgid
[[ $REPLY == 0 ]] || { echo "simworker: cannot join a process group (no warm pool)" >&2; exit 72; }
number "$line" heartbeat_interval
interval=$REPLY
for phase in store_connected joined training; do
    send "{\"type\":\"phase\",\"phase\":\"$phase\"}"
done
step=0
while :; do
    IFS= read -r -t "$interval" -u "$fd" line
    rc=$?
    if ((rc == 0)); then
        if [[ $line == '{"type":"stop"'* ]]; then
            send "{\"type\":\"result\",\"steps\":$step,\"stopped_early\":true}"
            exit 0
        fi
        continue  # anything else the daemon says is not for a simulated worker
    fi
    ((rc > 128)) || exit 71  # not a timeout: the channel closed
    step=$((step + 1))
    send "{\"type\":\"hb\",\"step\":$step}"
    if ((every > 0 && step % every == 0)); then
        send "{\"type\":\"progress\",\"step\":$step,\"loss\":0.5}"
    fi
done
