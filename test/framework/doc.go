// Package framework starts a throwaway credbroker fleet for integration
// tests, end-to-end tests and the demo: one hub and N spoke kube-apiservers,
// each with its own etcd, run by controller-runtime's envtest from the
// binaries that `make testbin` builds.
//
// Every cluster has its own serving CA, client CA, service account signing
// key and service account issuer (https://<name>.credbroker.test, also its
// default API audience), and authorizes with RBAC only. So a token minted by
// one cluster fails TokenReview on every other, and SubjectAccessReviews are
// answered by real RBAC. The hub also serves the ClusterProfile CRD from
// sigs.k8s.io/cluster-inventory-api. No controllers run: there are no default
// service accounts, and deleted namespaces never finish terminating.
//
// The binaries are found in Options.AssetsDir or $KUBEBUILDER_ASSETS; `make
// test` sets the latter. When they are missing, Start returns an error
// wrapping ErrMissingAssets that says to run `make testbin`. Tests must fail
// on that error, never skip.
//
// Functions return errors instead of taking a *testing.T, so programs can use
// the package too. Starting a hub and one spoke takes a few seconds, so a test
// package usually starts one Env in TestMain and isolates its tests by
// namespace:
//
//	env, err := framework.Start(ctx, framework.Options{Spokes: 1})
//	if err != nil {
//		return err // names `make testbin` when the binaries are missing
//	}
//	defer env.Stop()
//	hub, spoke := env.Hub, env.Spokes[0]
//
//	// A consumer on the hub, allowed to get tokens for ClusterProfile "spoke-1".
//	if _, err := hub.CreateServiceAccount(ctx, "team-a", "consumer", nil); err != nil {
//		return err
//	}
//	if err := hub.GrantClusterProfileToken(ctx, "fleet", "spoke-1", "team-a", "consumer"); err != nil {
//		return err
//	}
//	if _, err := hub.CreateClusterProfile(ctx, "fleet", "spoke-1", spoke.Access("credbroker", nil)); err != nil {
//		return err
//	}
//	hubToken, err := hub.Token(ctx, "team-a", "consumer", []string{"credbroker"}, time.Hour)
//
// Grant waits until the RBAC authorizer reflects the grant, so a
// SubjectAccessReview right after it sees the new permission.
//
// StartSPIRE runs a real SPIRE server on loopback, for tests of the broker
// and agents as SPIFFE workloads; its binaries come from `make spire`
// ($CREDBROKER_SPIRE). Each in-process component gets a SPIRE agent of its
// own (join-token node attestation) and an entry parented to it (unix
// workload attestation by uid), so each Workload API socket serves exactly
// one SVID, with a short TTL so that tests see it rotate:
//
//	s, err := framework.StartSPIRE(ctx, framework.SPIREOptions{X509SVIDTTL: 30 * time.Second})
//	defer s.Stop()
//	hub, err := s.StartAgent(ctx, "hub")
//	err = hub.RegisterWorkload(ctx, "spiffe://"+framework.TrustDomain+"/broker", os.Getuid())
//	// broker.Config.SPIFFEEndpointSocket = hub.Endpoint()
//
// Always call Env.Stop (in TestMain, after m.Run). As a safety net, on Linux
// with setpriv(1) the servers are started with a parent-death signal, so they
// exit when the process that started them dies without stopping them, for
// example on a test timeout; only their temporary folders are left behind.
package framework
