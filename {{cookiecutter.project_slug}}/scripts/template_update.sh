#!/usr/bin/env bash
# Template fixes as a branch to review, run by the scheduled CI job (or by hand, with cruft installed).
# Without .cruft.json (a project not linked to its template: `cruft link <template>`) it does nothing.
# When the template moved (the newest tag of the template's repository, or its recorded branch where
# it has no tags; TEMPLATE_REF names another), `cruft update` applies it on branch UPDATE_BRANCH
# (template-update), committed; the CI job pushes that branch and opens a pull (merge) request. A
# change of the template that conflicts with this project's own stays as a *.rej file in that commit.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -f .cruft.json ]]; then
  echo "template update: no .cruft.json (the project is not linked to its template); nothing to do"
  exit 0
fi
template=$(python3 -c 'import json; print(json.load(open(".cruft.json"))["template"])')
ref=${TEMPLATE_REF:-$(git ls-remote --tags --refs "$template" | sed 's#.*refs/tags/##' | sort -V | tail -n 1)}
checkout=(${ref:+--checkout "$ref"})
if cruft check "${checkout[@]}" > /dev/null; then
  echo "template update: up to date with $template${ref:+ $ref}"
  exit 0
fi
branch=${UPDATE_BRANCH:-template-update}
git switch -q -C "$branch"
cruft update -y "${checkout[@]}"
git add -A
git -c user.name="${GIT_AUTHOR_NAME:-template update}" -c user.email="${GIT_AUTHOR_EMAIL:-template-update@localhost}" \
  commit -q -m "Update from the template $template${ref:+ $ref}"
echo "template update: branch $branch holds $template${ref:+ $ref}; review it (and any *.rej file) in a pull request"
