#!/bin/sh
# keepalived notify hook for a fastpath HA pair: appends one line per VRRP transition,
#   <unix time with ns> <type> <instance> <state> <priority>
# to LOG (the first argument), e.g. `1763712000.123456789 INSTANCE fastpath MASTER 150`.
# Usage in keepalived.conf:  notify "/etc/keepalived/fastpath-notify.sh /var/log/fastpath-vrrp.log"
# keepalived appends TYPE (GROUP|INSTANCE), NAME, STATE (MASTER|BACKUP|FAULT|STOP) and the
# priority. The hook only records: promotion itself is gated by the track_script on
# `fastpath ha status --check` (see README.md), never by this script, which keepalived does
# not wait for.
set -u
log=${1:?usage: fastpath-notify.sh LOG TYPE NAME STATE [PRIORITY]}
shift
printf '%s %s %s %s %s\n' "$(date +%s.%N)" "${1:-?}" "${2:-?}" "${3:-?}" "${4:-?}" >> "$log"
