// Package brokerclient holds what every client of the broker's exchange
// port shares: the check of the broker's address, the TLS connection, the
// hub token read from a file and sent as "authorization: Bearer" only over
// a secure transport. credbroker-plugin (package plugin) and the credbroker
// command use it.
//
//	roots, err := brokerclient.LoadCAFile("ca.pem")
//	conn, err := brokerclient.Dial("credbroker.credbroker-system.svc:8443",
//		&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, "credbroker")
//	hubToken, err := brokerclient.ReadToken("/var/run/secrets/credbroker/token")
//	resp, err := pb.NewGrantsClient(conn).List(ctx, req, grpc.PerRPCCredentials(brokerclient.Bearer(hubToken)))
//
// Explain turns a refused call into the one line both show a person: the
// code in words, the broker's message, and what to fix, such as
//
//	permission denied: hub RBAC does not allow "system:serviceaccount:argocd:controller" to create
//	multicluster.x-k8s.io/clusterprofiles/token "prod-eu-1" in namespace "fleet"; grant it with a Role like deploy/examples/consumer-rbac.yaml
//
// (one line; wrapped here).
//
// Errors name files, never their content: a token read here never appears
// in an error, and Bearer's String is redacted.
package brokerclient
