#!/bin/sh
# Open MPI's remote agent (plm_rsh_agent) for the namespace "hosts" of tests/netns_cluster.py,
# in place of ssh: netns_agent.sh [ssh-style options] HOST COMMAND... runs COMMAND (one shell
# string, as ssh runs it) in HOST's network namespace (its hosts file mounted by `ip netns exec`)
# under HOST's host name, from the caller's side as an ssh client does.
while [ "${1#-}" != "$1" ]; do shift; done  # options meant for ssh
host=$1
shift
ip netns exec "$host" unshare --uts sh -c "hostname $host && $*" &
session=$!
trap 'kill $session 2>/dev/null; exit 143' TERM INT HUP  # the caller ends the session
wait $session
status=$?
if ip -n "$host" link show eth0 2>/dev/null | grep -q NO-CARRIER; then
  # The host's cable is pulled (tests/netns_cluster.py: Cluster.unplug): whatever ended the
  # session there, an ssh client to that machine would hear nothing. Wait, as it would, until
  # the caller ends the session.
  while :; do sleep 1; done
fi
exit "$status"
