# Context Tracker: one image for every role (migrate, API, counting worker, demo).
#
#   docker build -t context-tracker .
#   docker run --rm context-tracker --help
#   docker-compose up -d                  # the whole stack, see docker-compose.yml
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY tracker ./tracker
COPY workers ./workers
COPY alembic ./alembic
COPY examples ./examples

# Installed in place (-e): `tracker db upgrade` finds its Alembic migrations in /app/alembic
# (a built wheel carries them as tracker/alembic), and the demo's model registry
# is /app/tracker/demo/models.json.
RUN pip install -e . \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/tracker tracker \
 && mkdir -p /data \
 && chown tracker:tracker /data

# Unprivileged; without TRACKER_DATABASE_URL the embedded default database is
# $XDG_DATA_HOME/context-tracker/tracker.db, i.e. /data/context-tracker/tracker.db on the volume.
USER tracker
ENV XDG_DATA_HOME=/data
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8080

ENTRYPOINT ["tracker"]
CMD ["--help"]
