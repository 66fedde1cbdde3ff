# Shared by the scripts and .ci/run, sourced (`. scripts/lib.sh`), never run.
# shellcheck shell=bash

# Runs a command as root: directly when already root, else through sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# Installs Debian packages quietly, as root; fails if the index update or the install fails.
apt_install() {
    as_root apt-get update -qq &&
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}
