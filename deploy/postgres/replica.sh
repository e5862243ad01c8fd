#!/bin/sh
# The streaming replica (docker-compose --profile topology): on an empty volume, copy the primary
# with pg_basebackup -R (it writes standby.signal and primary_conninfo), then run PostgreSQL as a
# hot standby. The tracker's read side reads here (TRACKER_READ_DATABASE_URL); every write goes
# to the primary, through PgBouncer.
set -eu
PGDATA="${PGDATA:-/var/lib/postgresql/data}"
PRIMARY_HOST="${PRIMARY_HOST:-postgres}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    until pg_isready -q -h "$PRIMARY_HOST" -U "$POSTGRES_USER"; do sleep 1; done
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA"
    chmod 700 "$PGDATA"
    su-exec postgres env PGPASSWORD="$POSTGRES_PASSWORD" \
        pg_basebackup -h "$PRIMARY_HOST" -U "$POSTGRES_USER" -D "$PGDATA" -R -X stream --checkpoint=fast
fi
exec su-exec postgres postgres -c hot_standby=on
