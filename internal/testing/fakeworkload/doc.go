// Package fakeworkload is a SPIFFE Workload API server for tests: it serves
// on a unix socket the X.509-SVIDs and bundle that the test sets, and pushes
// every change to the watching clients, as a SPIRE agent does when it
// rotates an SVID. It serves only FetchX509SVID, which go-spiffe's
// X509Source uses.
//
// Start it, point the workload (workloadapi.WithAddr, or a binary's
// --spiffe-endpoint-socket) at Addr, and Set what it serves; Set again to
// rotate:
//
//	api, err := fakeworkload.Start()
//	require.NoError(t, err)
//	defer api.Stop()
//	require.NoError(t, api.Set(ca.BundlePEM(), fakeworkload.SVID{CertPEM: cert, KeyPEM: key}))
package fakeworkload
