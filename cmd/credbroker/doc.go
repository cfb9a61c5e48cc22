// Command credbroker is the command line of credbroker's Grants service:
// it lists and revokes the spoke tokens the broker handed out.
//
//	credbroker grants list --broker credbroker.example:8443 --ca-file ca.pem --token-file token [--cluster ns/name] [--user U] [--credential-id JTI=…] [-o table|json]
//	credbroker grants revoke --broker … --ca-file … --token-file - (--credential-id JTI=…|--user U|--cluster ns/name) [--reason text]
//
// The caller authenticates with a hub ServiceAccount token for the broker's
// audience (kubectl create token NAME --audience credbroker), read from
// --token-file, or from standard input with "-". A caller sees and revokes
// its own grants; other consumers' grants need hub RBAC on
// multicluster.x-k8s.io clusterprofiles/token of their ClusterProfile: list
// to see them, delete to revoke them.
//
// Exit codes: 0 on success, 1 when the broker refused or failed, 2 for a
// bad command line.
package main
