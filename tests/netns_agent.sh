#!/bin/sh
# Open MPI's remote agent (plm_rsh_agent) for the namespace "hosts" of tests/netns_cluster.py,
# in place of ssh: netns_agent.sh [ssh-style options] HOST COMMAND... runs COMMAND in HOST's
# network namespace (its hosts file mounted by `ip netns exec`) under HOST's host name.
while [ "${1#-}" != "$1" ]; do shift; done  # options meant for ssh
host=$1
shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"
