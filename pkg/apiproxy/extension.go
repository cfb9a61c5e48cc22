package apiproxy

import (
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

// DataPathExtensionName names the cluster extension, in a ClusterProfile's
// credbroker access provider entry, that says how the API proxy verifies
// the spoke API server it reaches through the agents. The publisher pins
// it there, as the agents first agreed on it, beside the proxy's own
// server and CA; an admin may write it instead. The proxy trusts it, and
// never what an agent offers at the moment: a stream that holds the
// agent's SVID cannot send the proxy's TLS connections, and the tokens in
// them, to a server of its own.
const DataPathExtensionName = "credbroker.io/data-path"

// DataPathConfig is the content of the DataPathExtensionName extension.
type DataPathConfig struct {
	// ServerName is the name the spoke API server's certificate is
	// verified against.
	ServerName string `json:"serverName"`
	// CertificateAuthorityData is the PEM bundle that verifies it.
	CertificateAuthorityData []byte `json:"certificateAuthorityData"`
}

// DataPathExtension returns the extension that records c.
func DataPathExtension(c DataPathConfig) clientcmdv1.NamedExtension {
	raw, _ := json.Marshal(c)
	return clientcmdv1.NamedExtension{Name: DataPathExtensionName, Extension: runtime.RawExtension{Raw: raw}}
}

// DataPathOf returns the data path recorded in the access provider entry
// named provider of cp's status, or an error saying why there is none.
func DataPathOf(cp *v1alpha1.ClusterProfile, provider string) (DataPathConfig, error) {
	for _, p := range cp.Status.AccessProviders {
		if p.Name != provider {
			continue
		}
		for _, e := range p.Cluster.Extensions {
			if e.Name != DataPathExtensionName {
				continue
			}
			var c DataPathConfig
			if err := json.Unmarshal(e.Extension.Raw, &c); err != nil || c.ServerName == "" || len(c.CertificateAuthorityData) == 0 {
				return DataPathConfig{}, fmt.Errorf("its %s extension is not {\"serverName\": ..., \"certificateAuthorityData\": ...}", DataPathExtensionName)
			}
			return c, nil
		}
		return DataPathConfig{}, fmt.Errorf("its access provider %s has no %s extension", provider, DataPathExtensionName)
	}
	return DataPathConfig{}, fmt.Errorf("it has no access provider %s", provider)
}
