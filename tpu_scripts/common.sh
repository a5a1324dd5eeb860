# Shared by the TPU scripts: flags every script takes, and `run`, which prints the exact command in
# --dry-run mode instead of running it. Source it; do not run it.

NAME="${POLYALIGN_TPU_NAME:-}"
ZONE="${POLYALIGN_TPU_ZONE:-}"
PROJECT="${POLYALIGN_TPU_PROJECT:-}"
DRY_RUN=0
REST=()

die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }

# Parses the common flags; everything else is left in REST for the script.
parse_common() {
  while (($#)); do
    case "$1" in
      --name) NAME="$2"; shift 2 ;;
      --zone) ZONE="$2"; shift 2 ;;
      --project) PROJECT="$2"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage; exit 0 ;;
      *) REST+=("$1"); shift ;;
    esac
  done
  [[ -n "$NAME" ]] || die "--name is required (or set POLYALIGN_TPU_NAME)"
  [[ -n "$ZONE" ]] || die "--zone is required (or set POLYALIGN_TPU_ZONE)"
  [[ -n "$PROJECT" ]] || die "--project is required (or set POLYALIGN_TPU_PROJECT)"
}

COMMON_HELP="  --name NAME        TPU (and queued resource) name   [env POLYALIGN_TPU_NAME]
  --zone ZONE        e.g. us-west4-a                  [env POLYALIGN_TPU_ZONE]
  --project PROJECT  Google Cloud project             [env POLYALIGN_TPU_PROJECT]
  --dry-run          print the exact commands instead of running them
  -h, --help         this help"

# run CMD ARGS...: execute, or print shell-quoted in dry-run mode.
run() {
  if ((DRY_RUN)); then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

# The flags every gcloud call needs.
where() { echo "--zone=$ZONE" "--project=$PROJECT"; }
