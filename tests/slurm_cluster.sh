#!/bin/bash
# A real Slurm (Debian's slurmctld, slurmd, munge) on one machine for tests/test_launch_slurm.py:
# slurmctld and N slurmd, each in its own network + UTS namespace, joined by a bridge that lives in
# a namespace of its own, so the machine's network and sysctls stay untouched.  The packages come
# from ci/setup.sh --tests.  Every daemon is bounded by SLC_TTL; `down` removes everything.
#
#   cluster.sh up            # start munged, slurmctld, slurmd on node1..nodeN
#   cluster.sh exec CMD...   # run a client command (sbatch, squeue...) in the ctl namespace
#   cluster.sh down          # kill everything, delete namespaces and state
#
# Env: SLC_DIR (state dir, default /tmp/slc), SLC_NODES (default 2),
#      SLC_TTL (max daemon lifetime in s, default 3600), SLC_NET (default 10.235.0)
set -u
SLC_DIR=${SLC_DIR:?set SLC_DIR to a new folder}
SLC_NODES=${SLC_NODES:-2}
SLC_TTL=${SLC_TTL:-3600}
NET=${SLC_NET:-10.235.0}
P=hslurm                      # namespace / interface prefix
CTL_NS=${P}ctl BR_NS=${P}br
CTL_IP=$NET.1
node_ip() { echo "$NET.$((10 + $1))"; }

log() { echo "[cluster.sh] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# run in namespace $1 with a private UTS ns whose hostname is $2
in_ns() { local ns=$1 hn=$2; shift 2
  ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0"; exec "$@"' "$hn" "$@"; }

install_pkgs() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
    command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
  die "Slurm is not installed (slurmctld, slurmd, slurm-client, munge); fix: bash ci/setup.sh --tests"
}

write_conf() {
  local d=$SLC_DIR n nodes="" i
  mkdir -p $d/etc $d/ctl $d/log $d/run $d/munge
  : > $d/etc/plugstack.conf
  # slurmd 22.05 always initialises a cgroup plugin; "autodetect" fails inside
  # 'ip netns exec' (it remounts /sys, so /sys/fs/cgroup is empty). Force v1.
  echo "CgroupPlugin=${SLC_CGROUP_PLUGIN:-cgroup/v1}" > $d/etc/cgroup.conf
  cat > $d/etc/hosts <<EOF
127.0.0.1 localhost
$CTL_IP ctl
EOF
  for i in $(seq 1 $SLC_NODES); do
    echo "$(node_ip $i) node$i" >> $d/etc/hosts
    nodes+="NodeName=node$i NodeAddr=$(node_ip $i) NodeHostname=node$i CPUs=$(nproc) State=UNKNOWN"$'\n'
  done
  cat > $d/etc/slurm.conf <<EOF
ClusterName=slc
SlurmctldHost=ctl($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/munge.socket
StateSaveLocation=$d/ctl
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdSpoolDir=$d/spool-%n
SlurmdPidFile=$d/run/slurmd-%n.pid
SlurmdLogFile=$d/log/slurmd-%n.log
PlugStackConfig=$d/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldDebug=info
SlurmdDebug=info
$nodes
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

mk_net() {
  local i ns
  ip netns add $BR_NS || die "ip netns add $BR_NS"
  ip -n $BR_NS link set lo up
  ip -n $BR_NS link add br0 type bridge
  ip -n $BR_NS link set br0 up
  add_port() { # $1=ns $2=ip
    ip netns add $1 || die "ip netns add $1"
    mkdir -p /etc/netns/$1 && cp $SLC_DIR/etc/hosts /etc/netns/$1/hosts
    ip -n $BR_NS link add v-$1 type veth peer name eth0 netns $1
    ip -n $BR_NS link set v-$1 master br0 up
    ip -n $1 link set lo up
    ip -n $1 addr add $2/24 dev eth0
    ip -n $1 link set eth0 up
  }
  add_port $CTL_NS $CTL_IP
  for i in $(seq 1 $SLC_NODES); do add_port ${P}n$i $(node_ip $i); done
}

start_daemons() {
  local d=$SLC_DIR i
  # munged: one daemon, unix socket on the shared filesystem serves every netns
  dd if=/dev/urandom of=$d/munge/munge.key bs=1 count=1024 status=none
  chmod 755 $d/munge; chmod 400 $d/munge/munge.key
  setsid timeout $SLC_TTL munged -F --force --key-file=$d/munge/munge.key \
    --socket=$d/munge/munge.socket --pid-file=$d/munge/munged.pid \
    --log-file=$d/log/munged.log --seed-file=$d/munge/munged.seed \
    </dev/null >>$d/log/munged.out 2>&1 &
  for i in $(seq 50); do [ -S $d/munge/munge.socket ] && break; sleep 0.1; done
  [ -S $d/munge/munge.socket ] || die "munged did not start: $(tail -3 $d/log/munged.log)"
  timeout 5 munge -S $d/munge/munge.socket -n | timeout 5 unmunge -S $d/munge/munge.socket >/dev/null ||
    die "munge self-test failed"

  export SLURM_CONF=$d/etc/slurm.conf
  setsid timeout $SLC_TTL ip netns exec $CTL_NS unshare --uts -- sh -c \
    'hostname ctl; exec slurmctld -D -i -f "$0"' $SLURM_CONF </dev/null >>$d/log/slurmctld.out 2>&1 &
  for i in $(seq 1 $SLC_NODES); do
    mkdir -p $d/spool-node$i; chmod 755 $d/spool-node$i
    setsid timeout $SLC_TTL ip netns exec ${P}n$i unshare --uts -- sh -c \
      'hostname "$1"; exec slurmd -D -f "$0" -N "$1"' $SLURM_CONF node$i </dev/null >>$d/log/slurmd-node$i.out 2>&1 &
  done
  # wait until all nodes are idle
  local want=$SLC_NODES got=0
  for i in $(seq 60); do
    got=$(ip netns exec $CTL_NS timeout 5 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    [ "$got" -ge "$want" ] && break
    sleep 0.5
  done
  [ "$got" -ge "$want" ] || { ip netns exec $CTL_NS timeout 5 sinfo -N; tail -5 $d/log/*.log; die "nodes not idle"; }
}

cmd_up() {
  [ "$(id -u)" = 0 ] || die "must be root"
  ip netns list | grep -q "^$CTL_NS\b" && die "already up (run down first)"
  install_pkgs
  rm -rf $SLC_DIR; mkdir -p $SLC_DIR; chmod 755 $SLC_DIR
  write_conf
  mk_net
  start_daemons
  log "up: $(ip netns exec $CTL_NS timeout 5 sinfo -h -N -o '%N:%T' | tr '\n' ' ')"
  log "submit with: $0 exec sbatch ...   (SLURM_CONF=$SLC_DIR/etc/slurm.conf)"
}

cmd_exec() {
  export SLURM_CONF=$SLC_DIR/etc/slurm.conf
  exec ip netns exec $CTL_NS "$@"
}

kill_pids() { # SIG pids...
  local s=$1; shift; [ $# -gt 0 ] && kill -$s "$@" 2>/dev/null; }

cmd_down() {
  local ns pids i
  # every process living in one of our network namespaces (daemons, slurmstepd, job tasks)
  for sig in TERM KILL; do
    pids=""
    for ns in $(ip netns list | awk '{print $1}' | grep "^$P"); do
      pids+=" $(ip netns pids $ns 2>/dev/null)"
    done
    [ -f $SLC_DIR/munge/munged.pid ] && pids+=" $(cat $SLC_DIR/munge/munged.pid)"
    pids=$(echo $pids)
    [ -z "$pids" ] && break
    kill_pids $sig $pids
    for i in $(seq 20); do
      local alive=""; for p in $pids; do kill -0 $p 2>/dev/null && alive+=" $p"; done
      [ -z "$alive" ] && break; sleep 0.25
    done
  done
  # the setsid'd timeout wrappers exit when their child dies; munged via pidfile done above
  for ns in $(ip netns list | awk '{print $1}' | grep "^$P"); do
    ip netns del $ns; rm -rf /etc/netns/$ns
  done
  rmdir /etc/netns 2>/dev/null || true
  rm -rf $SLC_DIR
  log "down"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  exec) shift; cmd_exec "$@" ;;
  *) echo "usage: $0 up|down|exec CMD..." >&2; exit 2 ;;
esac
