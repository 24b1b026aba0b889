#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (munge + slurmctld + slurmd), for the srun test
# (crates/qsr-train/tests/it/srun.rs). Run as root; needs Debian's slurm-wlm and munge packages.
# Idempotent: daemons already up are left alone; the script ends once `sinfo` shows the node idle.
# QSR_SLURM_WAIT_SECS bounds the wait (default 90).
set -euo pipefail

wait_secs="${QSR_SLURM_WAIT_SECS:-90}"
conf=/etc/slurm/slurm.conf
marker="# Written by qsr scripts/slurm-single-node.sh"
logdir=/var/log/slurm

die() {
  echo "slurm-single-node: FAILED: $*" >&2
  exit 1
}
# For daemon trouble: the failure, then the end of each log.
die_logs() {
  echo "slurm-single-node: FAILED: $*" >&2
  for f in "$logdir/slurmctld.log" "$logdir/slurmd.log" /var/log/munge/munged.log; do
    [ -s "$f" ] && { echo "--- last lines of $f:" >&2; tail -n 15 "$f" >&2; }
  done
  exit 1
}

[ "$(id -u)" = 0 ] || die "must run as root (it writes /etc/slurm and starts the daemons)"
for c in munged munge unmunge slurmctld slurmd sinfo scontrol srun runuser; do
  command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] ||
    die "\`$c\` not found: apt-get install -y slurm-wlm munge"
done
export PATH="$PATH:/usr/sbin"

host="$(hostname -s)"
[ -n "$host" ] || die "hostname -s is empty"
# slurmd runs only where its NodeName resolves to this machine.
getent hosts "$host" >/dev/null || die "host name $host does not resolve (add it to /etc/hosts)"

# Munge key: keep an existing one (the package may have made it); otherwise 1024 random bytes.
if [ ! -s /etc/munge/munge.key ]; then
  install -d -o munge -g munge -m 700 /etc/munge
  head -c 1024 /dev/urandom >/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 755 /run/munge
install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge

# The node line as slurmd itself measures this machine, so it is never drained for "low CPUs";
# RealMemory is left out (memory is not a consumable with CR_Core).
node="$(slurmd -C | sed -n 1p | sed -E -e 's/ RealMemory=[0-9]+//' -e "s/^NodeName=[^ ]+/NodeName=$host/")"
case "$node" in NodeName=*) ;; *) die "slurmd -C printed no node line: $node" ;; esac

new="$(mktemp)"
trap 'rm -f "$new"' EXIT
cat >"$new" <<EOF
$marker; rerunning it rewrites this file.
ClusterName=qsr
SlurmctldHost=$host
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$logdir/slurmctld.log
SlurmdLogFile=$logdir/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
$node
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

# Never overwrite a slurm.conf someone else wrote (this machine could be part of a real cluster).
if [ -e "$conf" ] && ! grep -qF "$marker" "$conf"; then
  die "$conf exists and was not written by this script; move it away to use a single-node test cluster"
fi
changed=0
if ! cmp -s "$new" "$conf" 2>/dev/null; then
  install -d /etc/slurm
  install -m 644 "$new" "$conf"
  changed=1
fi
install -d -m 755 /var/spool/slurmctld /var/spool/slurmd "$logdir"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# A new configuration needs the daemons restarted (node names, hosts); stop only the ones we track.
if [ "$changed" = 1 ]; then
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if alive "$pidfile"; then
      echo "slurm-single-node: $conf changed: stopping $(basename "$pidfile" .pid)"
      kill "$(cat "$pidfile")" 2>/dev/null || true
      for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.2; done
    fi
  done
fi

start=$SECONDS
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  echo "slurm-single-node: munged already up"
else
  runuser -u munge -- /usr/sbin/munged || die_logs "munged did not start"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n | unmunge >/dev/null || die_logs "munge does not work after starting munged"
fi
if alive /run/slurmctld.pid; then
  echo "slurm-single-node: slurmctld already up"
else
  /usr/sbin/slurmctld || die_logs "slurmctld did not start"
fi
if alive /run/slurmd.pid; then
  echo "slurm-single-node: slurmd already up"
else
  /usr/sbin/slurmd || die_logs "slurmd did not start"
fi

# Wait until the node takes jobs; a node left down/drained by an earlier run is resumed once.
resumed=0
while :; do
  state="$(sinfo -h -n "$host" -o %t 2>/dev/null | head -n 1 || true)"
  case "$state" in
    idle | mix | alloc) break ;;
    down* | drain* | drng*)
      if [ "$resumed" = 0 ]; then
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
        resumed=1
      fi
      ;;
  esac
  [ $((SECONDS - start)) -lt "$wait_secs" ] ||
    die_logs "node $host is not idle after ${wait_secs}s (sinfo state: '${state:-no answer}'; reason: $(sinfo -h -n "$host" -o %E 2>/dev/null || true))"
  sleep 1
done
# Right after a restart sinfo may show the state saved by the last controller before slurmd has
# registered: only a job that runs proves the cluster works.
until out="$(timeout 20 srun -n 1 --immediate=10 --job-name slurm-single-node-check true 2>&1)"; do
  [ $((SECONDS - start)) -lt "$wait_secs" ] ||
    die_logs "node $host is $state but a one-task job does not run within ${wait_secs}s: $out"
  sleep 1
done
echo "slurm-single-node: node $host is $state and runs jobs ($((SECONDS - start)) s)"
sinfo
