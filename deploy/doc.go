// Package deploy holds no Go code of its own: deploy/ is the kustomize bases
// for the hub and the spokes, their components, monitoring and examples
// (README.md there says how to use them). Its tests render every
// kustomization with the kubectl that `make testbin` builds, and hand every
// object to real API servers (test/framework) with server-side dry-run: hub
// objects to a hub with the ClusterProfile CRD, spoke objects to a spoke.
// They also check the rendered RBAC against the documented allow-lists, the
// images against VERSION, and that the agent's admission policies name the
// agent's own ServiceAccount whatever an overlay renames.
//
//	KUBEBUILDER_ASSETS=$(hack/testbin.sh) go test ./deploy/
package deploy
