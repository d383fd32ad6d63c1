#!/bin/bash
# Captures the real 22.05 samples in dbv0.0.38/ from the local dev cluster
# (deploy/devcluster/up must have run). Run as root; jobs run as alice.
# Each job's sacct JSON, sacct --parsable2 (the fallback's fields) and, while slurmctld
# still knows it, `scontrol --oneliner show job` are written beside it.
set -euo pipefail
out=$(cd "$(dirname "$0")" && pwd)/dbv0.0.38
work=/tmp/medic-samples
install -d -o alice -g alice "$work"
fields=JobID,JobIDRaw,User,UID,Group,Account,Partition,State,ExitCode,DerivedExitCode,NodeList,Submit,Start,End,WorkDir,JobName,Comment
submit() { sbatch --uid=alice --gid=alice --chdir="$work" --parsable "$@"; }
wait_done() {
  local id=$1
  for _ in $(seq 1 300); do
    state=$(sacct -n -X -P -j "$id" -o State | head -1)
    case "$state" in PENDING|RUNNING|REQUEUED|COMPLETING|"") sleep 1 ;; *) sleep 2; return 0 ;; esac
  done
  echo "job $id did not finish" >&2; return 1
}
save() {
  local name=$1 id=$2
  sacct --json -j "$id" > "$out/$name.json"
  sacct --parsable2 --noheader --delimiter=$'\x1f' --format=$fields -j "$id" > "$out/$name.parsable2"
}
script_failed='#!/bin/bash
echo "FAKE TRAINING LOG (sample capture, not a real OOM)"
srun bash -c '"'"'echo "task $SLURM_PROCID on $SLURMD_NODENAME"; [ "$SLURM_PROCID" = 2 ] && exit 1; exit 0'"'"'
'
failed=$(submit -N4 --ntasks-per-node=1 --job-name=train-4node --comment=tok-failed --output=%x-%j.out <<<"$script_failed")
cancelled=$(submit -N1 --job-name=to-cancel --output=%x-%j.out <<<$'#!/bin/bash\nsrun sleep 300\n')
timeout=$(submit -N1 --time=1 --job-name=short-limit --output=%x-%j.out <<<$'#!/bin/bash\nsrun sleep 300\n')
oom=$(submit -N1 --mem=200M --job-name=mem-hog --output=%x-%j.out <<<$'#!/bin/bash\nsrun python3 -c "import time; b = bytearray(600 * 2**20); time.sleep(25)"\n')
array=$(submit -N1 --array=0-2 --job-name=sweep --output=%x-%A_%a.out <<<$'#!/bin/bash\n[ "$SLURM_ARRAY_TASK_ID" = 1 ] && exit 3\nexit 0\n')
multi=$(submit -N2 --ntasks-per-node=1 --job-name=multi-step --output=%x-%j.out <<<$'#!/bin/bash\nsrun -N2 true\nsrun -N1 -n1 bash -c "exit 7"\nsrun -N2 hostname\nexit 0\n')
hostile_name=$'quote\'"$(touch /tmp/pwned)`id`\nline2 \xff\xfe end'
hostile_comment=$'c\'"$(touch /tmp/pwned);`id` UserId=x(1) GroupId=y\n2nd \xff'
hostile=$(submit -N1 --job-name="$hostile_name" --comment="$hostile_comment" --output=hostile-%j.out <<<$'#!/bin/bash\nexit 0\n')
het=$(submit --job-name=het <<<$'#!/bin/bash\n#SBATCH -N1\n#SBATCH hetjob\n#SBATCH -N1\nsrun --het-group=0,1 true\n' || true)
node_fail=$(submit -N1 -w gpu-04 --no-requeue --job-name=node-fail --output=%x-%j.out <<<$'#!/bin/bash\nsrun sleep 300\n')

# While they run: what slurmctld says of a running job, and of a drained node.
sleep 3
scontrol --oneliner show job "$failed" > "$out/scontrol-show-job-failed.txt" || true
scontrol --oneliner show job "$hostile" > "$out/scontrol-show-job-hostile.txt" || true
scontrol --oneliner show job "$cancelled" > "$out/scontrol-show-job-running.txt"
scancel "$cancelled"
# NODE_FAIL: take gpu-04 down under its running job, then give it straight back.
scontrol update NodeName=gpu-04 State=DOWN Reason="medic: sample capture NODE_FAIL"
sleep 2
# ReturnToService=2 usually returns it by itself; RESUME then says "Invalid node state".
scontrol update NodeName=gpu-04 State=RESUME 2>/dev/null || true
scontrol update NodeName=gpu-03 State=DRAIN Reason="medic: sample capture drain"
scontrol --oneliner show node > "$out/scontrol-show-nodes.txt"
scontrol --oneliner show node gpu-03 > "$out/scontrol-show-node-drained.txt"
scontrol update NodeName=gpu-03 State=RESUME
echo "$failed" > "$out/sbatch-parsable.txt"

for pair in failed:$failed cancelled:$cancelled timeout:$timeout cgroup-oom:$oom array:$array \
            multi-step:$multi hostile:$hostile node-fail:$node_fail ${het:+het:$het}; do
  name=${pair%%:*} id=${pair#*:}
  wait_done "$id"
  save "$name" "$id"
done
sacct --version > "$out/VERSION"
date -u +%Y-%m-%dT%H:%M:%SZ >> "$out/VERSION"
ls /tmp/pwned 2>/dev/null && echo "pwned file exists!" >&2 || true
