#!/bin/sh
# Run once by the postgres image when it initialises an empty data directory: lets the streaming
# replica of `docker-compose --profile topology` (postgres-replica) connect for replication with
# the tracker user's password. (PostgreSQL 16's defaults already have wal_level = replica and
# max_wal_senders = 10.) A data volume made before this file existed lacks the line: add it to
# pg_hba.conf by hand, or `docker-compose down -v`.
set -e
echo "host replication all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
