#!/usr/bin/env python3
"""Where a drill's stalled steps spent their time: which of the node's
threads waited, and on what.

Input: a drill's node trace and log (`target/drill/<drill>/node.jsonl`
and `node.log`; the log's `progress` lines tie the trace's clock to
CLOCK_MONOTONIC) and a `perf record` of the node's scheduler events,
clocked the same way:

    perf record -k CLOCK_MONOTONIC -e sched:sched_switch -g -p NODE_PID -o node.perf

For each decode step whose stall is over the threshold (ms, default 10),
it prints the step's hops per table (to I/O: waiting for the node's I/O
thread to take the fetch up; source: the gather or the round trip; to
loop), then every stretch in the step's window in which one of the
node's threads was off its core for at least 0.5 ms: the thread, how
long, its state when it left (S: asleep, D: in the kernel uninterruptibly,
R: preempted) and the kernel and user frames it left from (a futex in
`HostSource::read` is a lookup waiting for a lock; `rwsem_down_*` the
address space's lock; R a core taken by something else).

Frames are named from the binaries as they are now: trace a build and
read its trace before rebuilding. Run from the repository root:

    python3 scripts/stall-trace.py target/drill/restart-host-new-generation node.perf [10]
"""
import json
import re
import subprocess
import sys

SKIP = ('__schedule', 'schedule', 'entry_SYSCALL', 'do_syscall_64', 'finish_task_switch')


def offset_us(log):
    """CLOCK_MONOTONIC minus the trace's clock, from a progress line."""
    for line in open(log, encoding='utf-8', errors='replace'):
        m = re.search(r'progress steps=\d+ end_us=(\d+) monotonic_us=(\d+)', line)
        if m:
            return int(m.group(2)) - int(m.group(1))
    sys.exit(f'{log}: no progress line (run the node with --progress-every)')


def off_core(perf):
    """(thread, from s, to s, state, frames) for every stretch off a core:
    from the thread's switch-out to the next event it emits itself (a
    recording of one process sees a switch-in only when the thread
    switched out was one of its own, so a stretch ends, at the latest,
    where the thread next shows it runs)."""
    out = subprocess.run(
        ['perf', 'script', '-i', perf, '-F', 'comm,tid,time,event,trace,ip,sym'],
        capture_output=True, text=True, check=True).stdout
    left, stretches = {}, []
    for block in out.split('\n\n'):
        lines = block.strip('\n').split('\n')
        m = re.match(r'\s*(.*?)\s+(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)', lines[0])
        if not m:
            continue
        comm, tid, t, event, trace = m.groups()
        if tid in left:
            t0, st, fr = left.pop(tid)
            stretches.append((comm, t0, float(t), st, fr))
        sw = re.search(r'prev_pid=(\d+) .*prev_state=(\S+) ==>', trace)
        if event == 'sched:sched_switch' and sw and sw.group(1) == tid:
            frames = [l.strip().split(None, 1)[-1] for l in lines[1:]]
            left[tid] = (float(t), sw.group(2), [f for f in frames if not f.startswith(SKIP)][:8])
    return stretches


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run, perf = sys.argv[1], sys.argv[2]
    threshold_us = float(sys.argv[3]) * 1e3 if len(sys.argv) > 3 else 10_000.0
    off = offset_us(f'{run}/node.log') / 1e6
    stretches = off_core(perf)
    for line in open(f'{run}/node.jsonl', encoding='utf-8'):
        s = json.loads(line)
        if s.get('kind') == 'prefill' or s['stall_us'] < threshold_us:
            continue
        print(f"step {s['step']} at {s['start_us'] / 1e6:.3f} s: stall {s['stall_us'] / 1e3:.2f} ms")
        for t in s['tables']:
            h = t.get('hops') or {}
            print(f"  t{t['table']} from {t.get('source')}: to I/O {h.get('to_io_us', 0) / 1e3:.2f} ms,"
                  f" source {h.get('round_trip_us', 0) / 1e3:.2f} ms,"
                  f" to loop {h.get('to_loop_us', 0) / 1e3:.2f} ms")
        a = off + s['start_us'] / 1e6
        b = a + s['time_us'] / 1e6
        for name, t0, t1, st, fr in stretches:
            if t1 > a and t0 < b and t1 - t0 >= 0.0005:
                print(f"    {name:<16} off its core {(t1 - t0) * 1e3:7.2f} ms from {(t0 - off) * 1e3:9.2f} ms"
                      f" ({st}): {' < '.join(fr)}")


if __name__ == '__main__':
    main()
