# Shared names and helpers of the local dev cluster; sourced by up, down,
# set-node-state and node-sshd (not executable on its own).
# Everything the cluster creates is named here once, so `down` removes exactly
# what `up` made and nothing else.

DEVCLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$DEVCLUSTER_DIR/../.." && pwd)"
STATE="${DEVCLUSTER_STATE:-/var/lib/slurm-medic-devcluster}"

CLUSTER_NAME="medic-dev"
SLURM_ACCOUNT="training"
JOB_USERS=(alice bob)
SERVICE_USER="medic"

BRIDGE="br-slurm"
BRIDGE_ADDR="10.77.0.1"
NODE_COUNT=4
# Node i (1..4): name gpu-0i, namespace ni, address 10.77.0.1i, host-side veth veth-ni.
node_name() { printf 'gpu-%02d' "$1"; }
node_ns() { printf 'n%d' "$1"; }
node_addr() { printf '10.77.0.%d' "$((10 + $1))"; }
node_veth() { printf 'veth-n%d' "$1"; }
node_index() {  # gpu-03 -> 3; anything else is an error
    case "$1" in
        gpu-0[1-4]) echo "${1#gpu-0}" ;;
        *) echo "unknown node '$1' (expected gpu-01..gpu-04)" >&2; return 1 ;;
    esac
}

SLURM_ETC="/etc/slurm"
SLURM_CONFIGS=(slurm.conf slurmdbd.conf cgroup.conf gres.conf)
# Every file `up` writes outside $STATE starts with this line; `down` only
# removes files that carry it, so a hand-written config is never deleted.
MARKER="# Written by slurm-medic deploy/devcluster/up; removed by deploy/devcluster/down."
HOSTS_TAG="# slurm-medic-devcluster"
# The comment (GECOS) of the accounts `users` makes, so `down --purge` knows its own.
USER_TAG="slurm-medic devcluster"
# Says `up` started munged, so `down` may stop it (a munged that was already
# running serves someone else too). In munge's run dir, not $STATE: it must
# survive a `down` that was interrupted after deleting $STATE.
MUNGED_OURS="/run/munge/started-by-slurm-medic-devcluster"
# The lock lives outside $STATE because `down` deletes $STATE while holding it.
LOCK_FILE="/run/lock/slurm-medic-devcluster.lck"
# Where the cluster's EpilogSlurmctld (slurm-medic's hook) sends: a daemon of the tests that
# wants slurmctld's word listens here (`status --json`: hook_socket).
HOOK_SOCKET="$STATE/run/medic-hook.sock"

# Our MariaDB listens on loopback only, on a port of its own so that a MariaDB
# the machine may already run on 3306 is left alone.
DB_PORT=3307
SLURMCTLD_PORT=6817
SLURMDBD_PORT=6819

log() { printf '%s\n' "$*"; }
die() { printf 'devcluster: %s\n' "$*" >&2; exit 1; }

require_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (namespaces, daemons, /etc/hosts)"
}

# Serialise up/down/set-node-state/node-sshd: parallel test sessions call `up`.
# Call as `take_lock "$@"`: re-runs the script under flock(1). The lock must
# not sit on an fd of the script itself (`exec 9>lock; flock 9`): every daemon
# started would inherit that fd and hold the lock for as long as it runs.
# flock -o keeps the lock in the flock process only.
take_lock() {
    if [ "${DEVCLUSTER_LOCK_HELD:-}" != "$LOCK_FILE" ]; then
        export DEVCLUSTER_LOCK_HELD="$LOCK_FILE"
        exec flock -o "$LOCK_FILE" "$0" "$@"
    fi
}

# pid_alive PID COMM: the process exists and its name is COMM (so a recycled
# pid of some other program is not mistaken for our daemon).
pid_alive() {
    local pid="$1" comm="$2"
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]
}

# pidfile_alive FILE COMM: prints the pid when FILE names a live COMM.
pidfile_alive() {
    local file="$1" comm="$2" pid
    [ -r "$file" ] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    pid_alive "$pid" "$comm" || return 1
    echo "$pid"
}

# Pids listening on a local TCP port in the root namespace with the given name.
port_pids() {
    local port="$1" comm="$2" pid
    ss -Hltnp "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u |
        while read -r pid; do
            if pid_alive "$pid" "$comm"; then echo "$pid"; fi
        done
}

# Our processes found by what only ours have on their command line: slurmd -N
# gpu-0X, an sshd or mariadbd whose config/data lives under $STATE. Used to find
# leftovers whose pidfile or namespace name is gone after a crash.
scan_our_procs() {
    local dir pid comm cmd
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        comm="$(cat "$dir/comm" 2>/dev/null)" || continue
        case "$comm" in
            slurmd | sshd | mariadbd | mysqld) ;;
            *) continue ;;
        esac
        cmd="$(tr '\0' ' ' <"$dir/cmdline" 2>/dev/null)" || continue
        case "$comm:$cmd" in
            slurmd:*"-N gpu-0"[1-4]*) echo "$pid" ;;
            sshd:*"$STATE/nodes/"*) echo "$pid" ;;
            mariadbd:*"$STATE/mysql"* | mysqld:*"$STATE/mysql"*) echo "$pid" ;;
        esac
    done
}

# kill_pids PID...: TERM, wait up to ~5 s, then KILL what is left.
kill_pids() {
    local pids=("$@") pid left i
    [ "${#pids[@]}" -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for i in $(seq 50); do
        left=0
        for pid in "${pids[@]}"; do
            if [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; then
                left=1
            fi
        done
        [ "$left" -eq 0 ] && return 0
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

# Every process inside namespace NS (slurmd, sshd, slurmstepd, job tasks).
kill_netns_procs() {
    local ns="$1"
    ip netns list | grep -qw "^$ns" || return 0
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
    kill_pids "${pids[@]}"
}

# Remove our lines from /etc/hosts. Written in place (not sed -i / mv): in
# containers /etc/hosts is often a bind mount that cannot be replaced.
hosts_remove() {
    local kept
    kept="$(grep -v -- "$HOSTS_TAG" /etc/hosts || true)"
    printf '%s\n' "$kept" >/etc/hosts
}

# Files that running tests read (probe, fixture tools, authorized_keys, hosts)
# are replaced only when their content changes, and then by rename(2): an `up`
# from a second test session must not leave a moment where a file is empty.
# put_file DEST MODE < content
put_file() {
    local dest="$1" mode="$2" tmp
    tmp="$(dirname "$dest")/.$(basename "$dest").new.$$"
    cat >"$tmp"
    if cmp -s "$tmp" "$dest"; then rm -f "$tmp"; chmod "$mode" "$dest"; return 0; fi
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$dest"
}
# sync_file SRC DEST MODE
sync_file() { put_file "$2" "$3" <"$1"; }

# render TEMPLATE: print TEMPLATE with @NAME@ replaced by $NAME for the names below.
render() {
    sed -e "s|@STATE@|$STATE|g" \
        -e "s|@MARKER@|$MARKER|g" \
        -e "s|@CLUSTER_NAME@|$CLUSTER_NAME|g" \
        -e "s|@CONTROLLER@|$CONTROLLER|g" \
        -e "s|@BRIDGE_ADDR@|$BRIDGE_ADDR|g" \
        -e "s|@DB_PORT@|$DB_PORT|g" \
        -e "s|@DB_PASSWORD@|${DB_PASSWORD:-}|g" \
        -e "s|@NODE@|${NODE:-}|g" \
        -e "s|@NODE_ADDR@|${NODE_ADDR:-}|g" \
        "$1"
}

# Per-node sshd paths.
node_dir() { echo "$STATE/nodes/$1"; }
sshd_pidfile() { echo "$STATE/nodes/$1/sshd.pid"; }

# start_node_sshd I: (re)start node I's sshd inside its namespace.
start_node_sshd() {
    local i="$1" node dir
    node="$(node_name "$i")"
    dir="$(node_dir "$node")"
    mkdir -p /run/sshd
    # sshd needs its absolute path to re-exec itself for each connection.
    ip netns exec "$(node_ns "$i")" /usr/sbin/sshd -f "$dir/sshd_config" -E "$STATE/log/sshd-$node.log"
}

stop_node_sshd() {
    local node="$1" pid
    if pid="$(pidfile_alive "$(sshd_pidfile "$node")" sshd)"; then
        kill_pids "$pid"
    fi
    rm -f "$(sshd_pidfile "$node")"
}

# Wait until node I's sshd accepts TCP connections (bash /dev/tcp, inside the namespace).
wait_node_sshd() {
    local i="$1" n
    for n in $(seq 100); do
        if ip netns exec "$(node_ns "$i")" bash -c "exec 3<>/dev/tcp/$(node_addr "$i")/22" 2>/dev/null; then
            return 0
        fi
        sleep 0.05
    done
    die "sshd of $(node_name "$i") does not listen; see $STATE/log/sshd-$(node_name "$i").log"
}

# Install node-states/STATE as node NODE's fixture dir. `fixture` is a symlink
# to a fresh copy, replaced with rename(2) (mv -T), so a probe running at that
# moment reads either the old state or the new one, never a mix or nothing.
install_node_state() {
    local node="$1" state="$2" dir src copy old
    dir="$(node_dir "$node")"
    src="$DEVCLUSTER_DIR/node-states/$state"
    [ -d "$src" ] || die "no node state '$state' (have: $(ls "$DEVCLUSTER_DIR/node-states" | tr '\n' ' '))"
    # Already there, same content: nothing to swap (a probe may be reading it).
    if [ "$(cat "$dir/fixture-state" 2>/dev/null)" = "$state" ] && [ -L "$dir/fixture" ] &&
        diff -rq "$src" "$dir/fixture/" >/dev/null 2>&1; then
        return 0
    fi
    copy="$dir/fixture.$state.$(date +%s%N)"
    cp -r "$src" "$copy"
    chmod -R a+rX "$copy"
    old="$(readlink "$dir/fixture" 2>/dev/null || true)"
    if [ -e "$dir/fixture" ] && [ ! -L "$dir/fixture" ]; then rm -rf "$dir/fixture"; fi
    ln -sfn "$(basename "$copy")" "$dir/.fixture.link"
    mv -T "$dir/.fixture.link" "$dir/fixture"
    if [ -n "$old" ] && [ "$old" != "$(basename "$copy")" ]; then rm -rf "${dir:?}/$old"; fi
    echo "$state" >"$dir/fixture-state"
}
