#!/usr/bin/env bash
# Install the large code corpus (data.corpus=linux): Debian's linux-source package, which puts the
# kernel's source tarball at /usr/src/linux-source-<version>.tar.xz (~140 MB download; extrapolab reads
# the .c/.h files straight from the tarball, nothing is extracted). Not part of `make setup`: only the
# paper-scale preset (`demo --preset full`) needs it. Exits 1 with the manual command when it cannot install.
set -u
if ls /usr/src/linux-source-*.tar.* >/dev/null 2>&1; then
  echo "linux corpus: present ($(ls /usr/src/linux-source-*.tar.* | sort -V | tail -1))"; exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    echo "linux corpus: needs root; run 'sudo apt-get install -y --no-install-recommends linux-source'"; exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "linux corpus: needs apt-get (Debian/Ubuntu); on other systems put a kernel tarball anywhere and use --set data.corpus=linux:<path to linux-*.tar.xz>"; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# --no-install-recommends: the package recommends a kernel build toolchain, which the corpus does not need
if timeout 900 $SUDO apt-get install -y -q --no-install-recommends linux-source >/dev/null 2>&1 || \
   { timeout 300 $SUDO apt-get update -q >/dev/null 2>&1 && \
     timeout 900 $SUDO apt-get install -y -q --no-install-recommends linux-source >/dev/null 2>&1; }; then
  echo "linux corpus: installed $(ls /usr/src/linux-source-*.tar.* | sort -V | tail -1)"
else
  echo "linux corpus: apt-get install linux-source failed; run 'sudo apt-get install -y --no-install-recommends linux-source' by hand"; exit 1
fi
